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

A rank whose step failed can also hang before it ends, in its own code. When a peer dies during
``backward()``, gloo raises (``Connection closed by peer``) while later buckets' all-reduces are
still queued. The exception's traceback holds the training function's frame, and that frame the
DDP model: freeing the exception at the end of an ``except`` block frees the model, and
pybind11 frees DDP's ``Reducer`` with the GIL held. When the Reducer holds the last reference to
the group (in the capstone script it did, its ``finally:`` having destroyed the group),
``~ProcessGroupGloo`` joins its worker threads, GIL still held, while one of them, holding the
work queue's lock, waits for the GIL to release a finished work (gdb, torch 2.13.0: main thread
``tb_dealloc`` → ``Reducer::~Reducer`` → ``~ProcessGroupGloo`` → ``thread::join``; workers
``~AsyncAllreduceWork`` → ``take_gil`` and ``runLoop`` → ``mutex_lock``; destructors that can
block behind the GIL are pytorch/pytorch#56297, open). The rank never exits, so torchrun never
restarts the group: twice in 20 elastic capstone runs with the 2 cores busy, once in a
clean-clone CI run (``tests/capstone/test_capstone_torchrun.py``). So the exception a
rank ends with is kept (:func:`keep`) until ``os._exit``, never freed: :func:`run_then_exit`
keeps the one ``main`` raised, and the lab's other rank loops (``lk.run``'s ranks, the
workers of ``lk.torchrun.run_function``) keep theirs.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

__all__ = ["exit_now", "run_then_exit", "keep"]

_KEPT: list = []


def keep(exc: BaseException) -> None:
    """Hold ``exc`` (its traceback, the frames in it and all they hold) until the process ends
    with ``os._exit``: freeing them can hang a rank whose collective failed (module docstring)."""
    _KEPT.append(exc)


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
    except BaseException as exc:            # noqa: BLE001  (reported as the interpreter would)
        keep(exc)                           # never freed: the docstring says why
        if isinstance(exc, SystemExit):
            code = exc.code
        elif isinstance(exc, KeyboardInterrupt):
            sys.excepthook(type(exc), exc, exc.__traceback__)
            _exit_work()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            code = 130                      # not reached: SIGINT's default action ends us
        else:
            sys.excepthook(type(exc), exc, exc.__traceback__)
            code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):         # sys.exit("message"): the message, and 1
        print(code, file=sys.stderr)
        code = 1
    exit_now(code)
