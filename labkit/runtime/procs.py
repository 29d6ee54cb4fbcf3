"""Starting, killing and reaping processes, and free ports: the one owner of these mechanisms.

Every part of the lab that runs processes uses these helpers: the rank pool and its zygote
(:mod:`labkit.runtime.pool`, :mod:`labkit.runtime.zygote`), the grader's kernels
(:mod:`labkit.grading.kernel`) and the torchrun launcher (:mod:`labkit.runtime.torchrun`).

* :func:`free_port` — a TCP port on 127.0.0.1 chosen by the OS (never a fixed 29500: two
  kernels would collide).
* :func:`die_with_parent` — ask Linux to signal this process when its parent dies, so
  nothing outlives a killed kernel.
* :func:`signal_all` — send a signal to pids that may already be gone.
* :func:`marked` / :func:`kill_marked` — processes found by a token in their environment
  (a token every descendant inherits, so orphans whose parent died are found too), and
  killing them until none is left.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
from typing import Iterable

import psutil

__all__ = ["free_port", "die_with_parent", "signal_all", "marked", "kill_marked", "kill_and_wait"]

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the process that forked it dies.

    Returns False where the platform has no parent-death signal (then only the
    callers' socket-EOF checks and ``atexit`` handlers clean up).
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def signal_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every pid; pids already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def marked(var: str, tokens: str | Iterable[str]) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment sets ``var`` to one of ``tokens``."""
    wanted = {tokens} if isinstance(tokens, str) else set(tokens)
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(var) in wanted:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def kill_and_wait(procs: Iterable[psutil.Process], timeout: float = 3.0) -> list[psutil.Process]:
    """SIGKILL each process and wait up to ``timeout`` s for it to go; returns those left."""
    procs = list(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def kill_marked(var: str, tokens: str | Iterable[str], timeout: float = 5.0,
                rounds: int = 5) -> list[int]:
    """Kill every process marked ``var=token`` until none is left (a dying parent may still
    start a child, so the scan repeats up to ``rounds`` times). Returns the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        left = marked(var, tokens)
        if not left:
            break
        killed += [p.pid for p in left]
        kill_and_wait(left, timeout)
    return killed
