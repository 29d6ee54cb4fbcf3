"""The runtime: running a function on N real ranks, and owning every process the lab starts.

* :mod:`~labkit.runtime.launch` — :func:`run`, :func:`warmup`, :func:`shutdown` (the verbs);
* :mod:`~labkit.runtime.pool` / :mod:`~labkit.runtime.zygote` — the notebook's and the
  child's side of the warm-rank pool, speaking :mod:`~labkit.runtime.protocol`;
* :mod:`~labkit.runtime.pickling` — functions to the ranks by value, values back;
* :mod:`~labkit.runtime.result`, :mod:`~labkit.runtime.errors`, :mod:`~labkit.runtime.stacks`
  — what a job hands back, the errors that name the rank, where a hung rank is stuck;
* :mod:`~labkit.runtime.commtrace` / :mod:`~labkit.runtime.commview` — ``lk.run(...,
  trace=True)``: the collectives of every rank that reach the dispatcher, recorded in the ranks
  (:mod:`labkit.runtime.commtrace` says exactly what it sees), read in the notebook;
* :mod:`~labkit.runtime.procs` — the one owner of the lab's processes: every process tree the
  lab starts (ranks, torchrun jobs, grading kernels, checker processes) is started, found and
  stopped there.

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
