"""How a process that ran gloo collectives ends: with its exit code, not with an abort.

torch 2.13.0, gloo, Python 3.11 (any Python up to 3.13): a collective launched during
``backward()`` (every DDP bucket all-reduce) is launched while the ``contextvars`` context that
``torch.autograd.graph._engine_run_backward`` stashes in thread-local state is there, and gloo's
worker thread (``pt_gloo_runloop``) releases that work after it completes, which takes the GIL
(seen in gdb: ``~AsyncWork`` → ``~ThreadLocalState`` → ``decref`` → ``take_gil``). If the
interpreter has begun to finalize by then, CPython ends that thread with ``pthread_exit``
inside a ``noexcept`` destructor: ``terminate called without an active exception``, and a rank
that had finished its work dies of SIGABRT (pytorch/pytorch#117762 and #190489, open; the
abandoned pull request #179291 describes the same crash; Python 3.14 hangs such a thread
instead, python/cpython gh-87135). Seen here about once in 40 DDP script exits with two jobs on
the 2 cores, and twice in clean-clone CI runs. ``destroy_process_group()`` does not prevent it:
DDP's constructor is the first to import ``torch._dynamo``, which imports
``torch.distributed.nn.functional``, whose default arguments captured the world
``ProcessGroup`` at import time, so the group and its threads live until the interpreter ends
(``tests/claims/test_claims_gloo.py`` shows that part).

So the lab's rank processes end here, doing what the interpreter does before it finalizes —
wait for non-daemon threads (``threading._shutdown``), run the ``atexit`` handlers
(``logging``'s among them), flush the standard streams (exit code 120 if that fails, as
CPython) — and then leave with ``os._exit``: the interpreter never finalizes, and no gloo thread
can be caught half-way. What is not flushed by then is lost, as after any ``os._exit``: a
rank's files are closed before it ends, as they are in the lab's scripts.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

__all__ = ["exit_now", "run_then_exit"]


def exit_now(code: int = 0) -> NoReturn:
    """Do the interpreter's exit work, then end the process with ``code`` (120 if the standard
    streams cannot be flushed, as CPython)."""
    os._exit(code if _exit_work() else 120)


def _exit_work() -> bool:
    """Non-daemon threads joined, atexit handlers run, streams flushed (False: a flush failed)."""
    if threading.current_thread() is threading.main_thread():
        threading._shutdown()               # what Py_FinalizeEx does first: join the threads
    atexit._run_exitfuncs()
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            flushed = False
    return flushed


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a script's ``main()`` and end the process as Python would, without its teardown.

    The exit code is ``sys.exit(main())``'s: ``main``'s return value if it is an int (None is
    0), the code of a ``SystemExit``, 1 after an exception (reported by ``sys.excepthook``), and
    an interrupt ends the process by SIGINT, as an uncaught ``KeyboardInterrupt`` does.
    """
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _exit_work()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130                          # not reached: SIGINT's default action ends us
    except BaseException:                   # noqa: BLE001  (reported as the interpreter would)
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):         # sys.exit("message"): the message, and 1
        print(code, file=sys.stderr)
        code = 1
    exit_now(code)
