"""How a process that ran gloo collectives ends: with its exit code, not with an abort.

torch 2.13.0, gloo: a collective launched during ``backward()`` (every DDP bucket all-reduce)
keeps a Python object — the ``contextvars`` context ``torch.autograd.graph._engine_run_backward``
stashes in thread-local state — inside its work object, and gloo's worker thread
(``pt_gloo_runloop``) releases that work after it completes, which takes the GIL. If the
interpreter has begun to finalize by then, Python stops that thread inside a ``noexcept``
destructor: ``terminate called without an active exception``, and the rank that had finished
its work dies of SIGABRT (pytorch/pytorch#179291 describes it; here about one DDP script exit in
40 when two jobs share the 2 cores, and twice in clean-clone CI runs).
``destroy_process_group()`` does not prevent it: the first use of ``torch._dynamo`` after
``init_process_group`` (DDP's constructor makes it) imports ``torch.distributed.nn.functional``,
whose default arguments (``group=group.WORLD``) keep the world group alive until the
interpreter ends (``tests/claims/test_claims_gloo.py`` shows both).

So the lab's rank processes end here: the Python-level exit work is done (``atexit`` handlers,
``logging``'s among them; the standard streams flushed), then the process leaves with
``os._exit`` — the interpreter never finalizes, and no gloo thread can be caught half-way.
What is not flushed by then is lost, as after any ``os._exit``: a rank's files are closed
before it ends, as they are in the lab's scripts.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback
from typing import Callable, NoReturn

__all__ = ["exit_now", "run_then_exit"]


def exit_now(code: int = 0) -> NoReturn:
    """Run the ``atexit`` handlers, flush the standard streams, end the process with ``code``."""
    _exit_work()
    os._exit(code)


def _exit_work() -> None:
    atexit._run_exitfuncs()                 # what the interpreter runs first at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # a closed or broken stream: nothing left to save
            pass


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a script's ``main()`` and end the process as Python would, without its teardown.

    The exit code is Python's own: ``main``'s return value if it is an int (None is 0), the
    code of a ``SystemExit``, 1 after an exception (its traceback printed to stderr), and an
    interrupt ends the process by SIGINT, as an uncaught ``KeyboardInterrupt`` does.
    """
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        _exit_work()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130                          # not reached: SIGINT's default action ends us
    except BaseException:                   # noqa: BLE001  (printed as the interpreter would)
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):         # sys.exit("message"): the message, and 1
        print(code, file=sys.stderr)
        code = 1
    exit_now(code)
