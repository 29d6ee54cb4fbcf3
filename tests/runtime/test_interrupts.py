"""Ctrl-C during ``lk.run``: at every stage of a job, by every route a signal takes, never lost.

Each case sends SIGINT at one point of a job (a hook on the runner's function for that stage,
or the job's own rank) and checks that ``KeyboardInterrupt`` is raised soon after, that every
rank of that job is killed and reaped, and that the next ``lk.run`` works. Routes:

* ``direct``: the main thread sends it to its own process (as the stop button does);
* ``finaliser``: sent from a ``__del__``; Python's default handler would raise inside the
  finaliser, where a ``KeyboardInterrupt`` is only printed ("Exception ignored in") and lost;
* ``outside``: a rank sends it while the notebook waits for the job (another process, like
  Jupyter's interrupt);
* ``thread``: the same, with SIGINT blocked in the main thread, so the kernel delivers it to
  another thread (the zygote's reaper, blocked in ``waitpid``) and the main thread's ``poll``
  is not cut short: only the wake-up descriptor can end that wait.

Latency is bounded loosely (the job's deadline, which a lost interrupt would wait out, is
20 s): under 2 s while the notebook waits for the job (the wait ends within milliseconds; the
rest is killing and reaping), under 5 s for the other stages, which let a fork or a rank's
stack dump in flight finish on a loaded machine. The measured values are printed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import psutil
import pytest

import labkit as lk
from conftest import assert_no_ranks_left
from labkit.runtime import launch
from labkit.runtime import pool as pool_module
from labkit.runtime.pool import Pool, Zygote
from labkit.runtime.protocol import JOB

pytestmark = pytest.mark.timeout(120)

_DEADLINE = 20.0   # what a lost interrupt would wait out (far above either bound)


def quick(rank, world_size):
    return rank


def hangs(rank, world_size):
    time.sleep(60)


def interrupts_the_notebook(rank, world_size, notebook, stamp):
    """Rank 0 sends SIGINT to the notebook while it waits; every rank then hangs."""
    if rank == 0:
        time.sleep(0.3)
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(notebook, signal.SIGINT)
    time.sleep(60)


class _SendsFromFinaliser:
    """SIGINT sent from a finaliser: the handler runs inside ``__del__``, not in the runner."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # bytecodes: a pending handler runs here
            pass


def _firing(original, route: str, fired: list, when=lambda *a, **k: True):
    """``original``, sending SIGINT by ``route`` first (once, when ``when(*args)`` holds)."""
    def hooked(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            fired.append(time.time())
            if route == "direct":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                _SendsFromFinaliser()  # dropped at once: its __del__ runs here
        return original(*args, **kwargs)
    return hooked


# stage: (object, name of the function hooked, when it fires, job, run options)
STAGES = {
    "pickle": (launch, "pickle_job", None, hangs, {}),
    "fork": (Zygote, "_forked", None, hangs, dict(fresh=True)),
    "rendezvous": (Pool, "_rendezvous", None, hangs, dict(fresh=True)),
    "send": (Connection, "send_bytes", lambda conn, buf: ForkingPickler.loads(buf)[0] == JOB,
             hangs, {}),
    "results": (pool_module, "_fill", None, quick, {}),
    "stack dump": (Pool, "_dump_stack", None, hangs, dict(deadline=1)),
}
CASES = [(stage, route) for stage in STAGES for route in ("direct", "finaliser")]
CASES += [("wait", "outside"), ("wait", "thread")]


@contextlib.contextmanager
def _sigint_blocked_here(block: bool):
    """Block SIGINT in this (the main) thread only: other threads still take it."""
    if not block:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@pytest.mark.parametrize("stage, route", CASES)
def test_interrupt_is_raised_kills_the_job_and_the_next_job_runs(stage, route, monkeypatch,
                                                                 tmp_path):
    lk.run(quick, world_size=2, echo=False)  # a warm pool: what the job would reuse
    warm = launch._pool
    jobs_before = warm.jobs
    forked: list[int] = []
    monkeypatch.setattr(Pool, "_rendezvous", _recording(Pool._rendezvous, forked))
    fired: list[float] = []
    opts = dict(timeout=30, deadline=_DEADLINE, echo=False)
    if stage == "wait":
        stamp = tmp_path / "fired"
        fn, args = interrupts_the_notebook, (os.getpid(), str(stamp))
        if route == "thread":
            assert any(t.name == "labkit-reaper" for t in threading.enumerate())
    else:
        owner, name, when, fn, more = STAGES[stage]
        args = ()
        opts.update(more)
        hook = _firing(getattr(owner, name), route, fired, when or (lambda *a, **k: True))
        monkeypatch.setattr(owner, name, hook)
    swallowed = []  # what Python printed as "Exception ignored" (the finaliser route)
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    with _sigint_blocked_here(route == "thread"), pytest.raises(KeyboardInterrupt):
        lk.run(fn, world_size=2, args=args, **opts)
    raised = time.time()
    monkeypatch.undo()
    if stage == "wait":
        fired.append(float(stamp.read_text()))
    latency = raised - fired[0]
    print(f"{stage} / {route}: KeyboardInterrupt {latency:.3f} s after SIGINT "
          f"({len(swallowed)} swallowed by a finaliser on the way)")
    assert latency < (2.0 if stage == "wait" else 5.0), f"{latency:.1f} s"
    if stage == "pickle":  # nothing was sent: the warm pool is kept, and reused
        assert launch._pool is warm and warm.jobs == jobs_before
        assert lk.run(quick, world_size=2, echo=False).cold is False
    else:
        assert launch._pool is None
        job_ranks = forked or warm.pids
        assert not [p for p in job_ranks if psutil.pid_exists(p)], "a rank of the job is left"
        assert_no_ranks_left()
    assert lk.run(quick, world_size=2, echo=False).values == [0, 1]


def _recording(original, pids: list):
    def rendezvous(self, limit):
        pids.extend(self.pids)
        return original(self, limit)
    return rendezvous


def test_a_second_interrupt_does_not_cut_the_cleanup_short(monkeypatch):
    """Stop pressed again while the ranks are being killed: they are still killed and reaped."""
    lk.run(quick, world_size=2, echo=False)
    pids = launch._pool.pids
    again: list[float] = []
    monkeypatch.setattr(Zygote, "wait_exits", _firing(Zygote.wait_exits, "direct", again))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        lk.run(hangs, world_size=2, timeout=30, deadline=_DEADLINE, echo=False)
    monkeypatch.undo()
    assert again, "the second interrupt was not sent"
    assert not [p for p in pids if psutil.pid_exists(p)], "a rank of the job is left"
    assert_no_ranks_left()
    assert lk.run(quick, world_size=2, echo=False).values == [0, 1]


def test_after_a_job_the_sigint_handler_and_wakeup_fd_are_as_they_were():
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    handler = signal.getsignal(signal.SIGINT)
    lk.run(quick, world_size=2, echo=False)
    assert signal.getsignal(signal.SIGINT) is handler
    assert signal.set_wakeup_fd(wakeup_fd) == wakeup_fd
