"""A notebook function as a torchrun script's entry point: notebook 05's core build, launched for real.

The build: ``torchrun_main(body, *args)``, the lines that make a plain script a torchrun script
(read ``RANK`` and ``WORLD_SIZE`` from the environment torchrun sets, join the process group
from that environment, leave it), around a ``body(rank, world_size, *args)`` that does the work.
:func:`launch_main` ships such a function by value (cloudpickle) into the script torchrun starts
in every worker (:mod:`labkit.torchrun.script`), so a function written in a notebook cell runs
exactly as a file launched by torchrun would: restarts, ``SIGKILL`` and all::

    job = lk.torchrun.launch_main(torchrun_main, lk.torchrun.train_body,
                                  ["--snapshot-dir", snap], max_restarts=1)
    lk.torchrun.follow(job, until="snapshot: step 16")   # the lines worth reading, live
    job.kill(rank=1)
    run = lk.torchrun.wait(job)

:func:`torchrun_main` is the lab's own version (the notebook falls back on it while the
learner's has not passed its checker); it is marked with
:func:`labkit.grading.references.reference`, so an answer that calls it fails a named case.
:func:`follow` and :func:`wait` print what a reader needs of a job's log (the agent's
restarts and failures, each rank's own lines, the last line of a traceback) instead of every
line.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ..grading.references import reference
from ..runtime.torchrun import Job, Line, Run, launch

__all__ = ["torchrun_main", "train_body", "launch_main", "launch_call", "follow", "wait",
           "SCRIPT"]

SCRIPT = "labkit.torchrun.script"      # what torchrun runs: ``python -m labkit.torchrun.script``


@reference
def torchrun_main(body: Callable, *args):
    """The lab's entry point of a torchrun script: join the job torchrun started as this worker's
    ``RANK`` of ``WORLD_SIZE``, run ``body(rank, world_size, *args)``, leave the group."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")           # MASTER_ADDR, MASTER_PORT, RANK ... from torchrun
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def train_body(rank: int, world_size: int, argv: list[str]) -> None:
    """The body notebook 05 launches: say who this worker is, then train with the lab's script
    (:func:`labkit.torchrun.train.train`, snapshots and resume included) in the group the entry
    point joined."""
    import torch.distributed as dist

    from .train import parse_args, train

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the body ran without a process group: the entry point must call "
                           "dist.init_process_group before it calls the body")
    if (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        raise RuntimeError(f"the entry point passed rank {rank} of {world_size}, but the group "
                           f"says rank {dist.get_rank()} of {dist.get_world_size()}")
    print(f"rank {rank} of {world_size} joined (LOCAL_RANK={os.environ.get('LOCAL_RANK')}, "
          f"MASTER_PORT={os.environ.get('MASTER_PORT')}, "
          f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
    train(parse_args(argv))


def launch_call(fn: Callable, args: tuple = (), **kw) -> Job:
    """Launch torchrun on the script that calls ``fn(*args)`` in every worker (its entry point,
    under ``@record``); ``kw`` goes to :func:`labkit.runtime.torchrun.launch`. ``fn`` travels
    by value when the workers could not import it (a notebook cell, a test file)."""
    folder = tempfile.mkdtemp(prefix="labkit-entry-")
    payload = Path(folder) / "call.pkl"
    payload.write_bytes(_dumps(fn, tuple(args)))
    try:
        job = launch(SCRIPT, [str(payload)], **kw)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    job.tree.dirs.append(folder)               # removed with the job's logs when it ends
    return job


def _dumps(fn: Callable, args: tuple) -> bytes:
    """``(fn, {"args": args})`` pickled, every function among them by value whose module the
    workers could not import (``__main__`` is by value already; a test file, a local script)."""
    import cloudpickle

    mods = set()
    for obj in (fn, *args):
        mod = sys.modules.get(getattr(obj, "__module__", None) or "") if callable(obj) else None
        path = getattr(mod, "__file__", None) or ""
        if (mod is not None and mod.__name__ != "__main__" and not mod.__name__.startswith(
                "labkit") and "site-packages" not in path):
            mods.add(mod)
    for mod in mods:
        cloudpickle.register_pickle_by_value(mod)
    try:
        return cloudpickle.dumps((fn, {"args": args}))
    finally:
        for mod in mods:
            cloudpickle.unregister_pickle_by_value(mod)


def launch_main(main: Callable, body: Callable = train_body, args: list | tuple = (),
                **kw) -> Job:
    """Launch torchrun on a script whose entry point is ``main(body, *args)`` (a
    ``torchrun_main``); ``kw`` goes to :func:`labkit.runtime.torchrun.launch` (``nproc_per_node``,
    ``max_restarts``, ``nnodes``, ``echo`` ...). Returns the running :class:`Job`."""
    return launch_call(main, (body, *args), **kw)


_TRACE = re.compile(r"^\s")                                  # a traceback's inner lines
_ERROR = re.compile(r"^\s*[\w.]*(Error|Exception|Fault|Interrupt|Exit)\b.*")
_AGENT = ("Starting worker group", "failed (exitcode", "will restart", "successfully finished",
          "attempts left")


def worth_reading(line: Line) -> bool:
    """Whether :func:`follow` prints ``line``: what the notebook wrote, the agent's start,
    failure, restart and finish lines and its failure summary, each rank's own lines, and of a
    traceback only its last line (the error)."""
    if line.source == "notebook":
        return True
    if line.source == "agent":
        return any(k in line.text for k in _AGENT) or (line.key and line.level == "")
    if "RuntimeWarning" in line.text:
        return False
    return not _TRACE.match(line.text) or bool(_ERROR.match(line.text))


def follow(job: Job, until: str | Callable[[Line], bool] | None = None,
           timeout: float = 180.0) -> Line | None:
    """``job.follow(until, timeout)``, printing only the lines :func:`worth_reading` (every
    line stays in ``job.lines``). Returns the first line matching ``until`` (a substring or a
    predicate), or None when the job has ended."""
    match = until if callable(until) or until is None else (lambda ln: until in ln.text)
    echo, job.echo = job.echo, False        # this function prints; job.kill() still says so

    def show(line: Line) -> bool:
        if worth_reading(line):
            text = line.format()
            print(text if len(text) <= 160 else text[:157] + "...", flush=True)
        return bool(match and match(line))

    try:
        return job.follow(show, timeout)
    finally:
        job.echo = echo


def wait(job: Job, timeout: float = 180.0) -> Run:
    """Follow ``job`` to its end (printing as :func:`follow`) and return its :class:`Run`."""
    follow(job, None, timeout)
    return job.wait(timeout)
