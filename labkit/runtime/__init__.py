"""The runtime: running a function on N real ranks, and owning every process the lab starts.

The core of ``lk.run``, at this level:

* :mod:`~labkit.runtime.launch` — :func:`run`, :func:`warmup`, :func:`shutdown` (the verbs);
* :mod:`~labkit.runtime.pool` / :mod:`~labkit.runtime.zygote` — the notebook's and the
  child's side of the warm-rank pool, speaking :mod:`~labkit.runtime.protocol`;
* :mod:`~labkit.runtime.pickling` — functions to the ranks by value, values back;
* :mod:`~labkit.runtime.result`, :mod:`~labkit.runtime.errors`, :mod:`~labkit.runtime.stacks`
  — what a job hands back, the errors that name the rank, where a hung rank is stuck;
* :mod:`~labkit.runtime.procs` — the one owner of the lab's processes: every process tree the
  lab starts (ranks, torchrun jobs, grading kernels, checker processes) is started, found and
  stopped there;
* :mod:`~labkit.runtime.bench` — launch latency, measured.

Two wings built on it:

* :mod:`~labkit.runtime.torchrun` — torchrun launched from a notebook (notebooks 04, 05, 08):
  the launcher, :mod:`~labkit.runtime.torchrun.log` (its log, read) and
  :mod:`~labkit.runtime.torchrun.function` (a notebook function as a torchrun ``main()``);
* :mod:`~labkit.runtime.commtrace` — ``lk.run(..., trace=True)`` (notebook 07, and the
  checkers' byte counts): the collectives of every rank that reach the dispatcher, recorded in
  the ranks (the package says exactly what it sees), and :mod:`~labkit.runtime.commtrace.view`,
  their reading in the notebook.

Nothing here imports torch in the notebook's process.
"""
from .errors import (BackendUnavailable, InvalidJob, JobFailed, JobTimeout, LabkitError,
                     RankCrashed, RankError, RemoteTraceback, ResultNotPicklable,
                     UnsupportedPlatform)
from .launch import MAX_WORLD_SIZE, check_platform, run, shutdown, warmup
from .result import JobResult, RankResult

__all__ = ["run", "warmup", "shutdown", "check_platform", "MAX_WORLD_SIZE",
           "JobResult", "RankResult", "LabkitError", "InvalidJob", "UnsupportedPlatform",
           "BackendUnavailable", "JobFailed", "RankError", "ResultNotPicklable", "RankCrashed",
           "JobTimeout", "RemoteTraceback"]
