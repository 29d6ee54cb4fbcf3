"""Teaching variants of one DDP script, as complete files with small diffs (notebook 05).

``ddp_spawn.py`` starts its own ranks with ``mp.spawn``; ``ddp_torchrun.py`` is
the same script launched by ``torchrun``. ``difflib`` between the two files is
the lesson; tests/test_examples.py runs both and checks they train identically.
"""
