"""What the learner's projects take with them: three plain-Python files, nothing of the lab.

Notebook 05's ``torchrun/train.py`` and notebook 08's capstone import these and nothing else of
``labkit`` (tested), so ``python -m labkit export`` copies them beside a project into a folder
that runs with torch alone:

* :mod:`~labkit.portable.checkpoints` — keep the last K checkpoints, prove each whole, fall back;
* :mod:`~labkit.portable.elastic` — torch's ``@record``, its error file written whole;
* :mod:`~labkit.portable.ending` — how a process that ran gloo collectives ends: with its exit
  code, never an abort in the interpreter's teardown nor a hang freeing a failed step (the
  torchrun function worker of :mod:`labkit.runtime.torchrun` ends this way too, and ``lk.run``'s
  ranks keep a failed job's exception as it does).

The lowest layer of code (only ``labkit.syllabus`` lies under it): these files import nothing of
``labkit``.
"""
