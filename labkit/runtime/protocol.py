"""The messages between the notebook, the zygote and the ranks, and the spec of a pool.

Both ends import their vocabulary from here (:mod:`labkit.runtime.pool` is the notebook's side,
:mod:`labkit.runtime.zygote` the child side), so a kind of message is spelt once.

Notebook ↔ zygote (a SOCK_SEQPACKET socket; rank sockets travel with SCM_RIGHTS)::

    zygote → notebook   (HELLO, pid, gpu_count)        torch imported, ready to fork
    notebook → zygote   (FORK, PoolSpec, dynamo)       fork world_size ranks (dynamo: the job
                                                       needs torch._dynamo, labkit.runtime.preload)
    zygote → notebook   (FORKED, [pid, ...], dynamo) + fds  one socket per rank; dynamo: the
                                                       ranks have torch._dynamo imported
    zygote → notebook   (EXIT, pid, wait_status)       a rank was reaped

Notebook ↔ rank r (a socket pair, multiprocessing Connection framing)::

    rank 0 → notebook   (PORT, port)                   rank 0's TCPStore listens here
    notebook → rank r   (PORT, port)                   for r > 0
    rank → notebook     (READY, pid)                   process group initialised
    notebook → rank     (JOB, {payload, cwd, sys_path, trace})   the same bytes to every rank
    rank → notebook     (DONE, report)                 see labkit.runtime.zygote

A rank's output during a job goes to its two files in the pool's folder (:func:`output_paths`),
emptied when a job starts and read by the notebook once the rank is done.

``trace`` (bool): record the rank's collectives (labkit.runtime.commtrace); the report then
carries ``trace`` (a list of record dicts) and ``trace_dropped``.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

__all__ = ["HELLO", "FORK", "FORKED", "EXIT", "PORT", "READY", "JOB", "DONE", "PoolSpec",
           "output_paths", "stack_path"]

HELLO, FORK, FORKED, EXIT = "hello", "fork", "forked", "exit"
PORT, READY, JOB, DONE = "port", "ready", "job", "done"


@dataclass(frozen=True)
class PoolSpec:
    """What a pool of warm ranks is: two jobs with equal specs (and env) share one pool."""

    world_size: int
    backend: str
    timeout: float
    threads: int
    idle_timeout: float
    dir: str = ""          # the pool's folder of per-job output files (set by the pool)

    def with_dir(self, path: str) -> "PoolSpec":
        return PoolSpec(**{**asdict(self), "dir": path})

    def as_dict(self) -> dict:
        return asdict(self)


def output_paths(folder: str, rank: int) -> tuple[str, str]:
    """Where rank ``rank`` of the pool in ``folder`` writes its stdout and stderr."""
    return os.path.join(folder, f"rank{rank}.out"), os.path.join(folder, f"rank{rank}.err")


def stack_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` of the pool in ``folder`` dumps its threads' stacks on SIGUSR1."""
    return os.path.join(folder, f"rank{rank}.stack")
