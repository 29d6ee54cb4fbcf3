"""The errors labkit raises, and why each one is a lesson.

Every error names what happened, which rank, and what to do next. A job that
fails raises a :class:`JobFailed` subclass carrying the whole
:class:`~labkit.runtime.result.JobResult` (``err.result``), so a notebook can inspect
per-rank output, stacks and exit codes after the fact. The remote traceback of
the first rank that raised is attached as ``__cause__`` (as joblib/loky do).

Hierarchy::

    LabkitError
    ├── InvalidJob          (also ValueError)  bad arguments, nothing was started
    │   └── UnsupportedPlatform                not Linux: the runner needs fork + prctl
    ├── BackendUnavailable                     e.g. backend="nccl" without GPUs
    └── JobFailed                              the job ran and a rank failed
        ├── RankError                          a rank raised a Python exception
        │   └── ResultNotPicklable             a rank returned something unpicklable
        ├── RankCrashed                        a rank process died (exit code / signal)
        └── JobTimeout                         ranks still running at the deadline
"""
from __future__ import annotations

__all__ = [
    "LabkitError", "InvalidJob", "BackendUnavailable", "JobFailed",
    "RankError", "ResultNotPicklable", "RankCrashed", "JobTimeout", "RemoteTraceback",
    "UnsupportedPlatform", "error_for",
]


class LabkitError(Exception):
    """Base class of every error labkit raises on purpose."""


class InvalidJob(LabkitError, ValueError):
    """The job was rejected before any process was started."""


class UnsupportedPlatform(InvalidJob):
    """The runner cannot serve this operating system (the message names the way out)."""


class BackendUnavailable(LabkitError):
    """The requested backend cannot run here (e.g. NCCL without enough GPUs)."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised inside a rank."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + self.tb


class JobFailed(LabkitError):
    """A job ran and at least one rank did not return a value.

    ``result`` is the full :class:`~labkit.runtime.result.JobResult`: every rank's
    status, output, exit code or signal, and stack (for hung ranks).
    """

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result

    @property
    def failed_ranks(self) -> list[int]:
        return [] if self.result is None else self.result.failed_ranks


class RankError(JobFailed):
    """A rank raised a Python exception (its traceback is ``__cause__``)."""


class ResultNotPicklable(RankError):
    """A rank returned a value that cannot be sent back to the notebook."""


class RankCrashed(JobFailed):
    """A rank process ended without reporting: ``os._exit``, a signal, an abort."""


class JobTimeout(JobFailed):
    """The job ran past its deadline; the message shows where each rank was stuck."""


# ------------------------------------------------------- the error for a failed job
_HINTS = {
    "SIGABRT": {"gloo": "a C++ abort: with gloo this is usually a collective called with a "
                        "different size or dtype on different ranks. Give every rank the same "
                        "shape and dtype.",
                "nccl": "a C++ abort: with NCCL this is usually the watchdog tearing the process "
                        "down after a collective timed out (a rank that never joined, or a "
                        "mismatched collective). Look for 'Watchdog caught collective operation "
                        "timeout' in the ranks' stderr."},
    "SIGKILL": "killed from outside (kill -9) or by the out-of-memory killer.",
    "SIGSEGV": "a crash in native code; the Python stack at the crash is in its stderr.",
}


def error_for(result) -> JobFailed:
    """The error to raise for a failed job: its class follows the rank that failed first."""
    first = result.first_failure()
    cls = {"raised": RankError, "unpicklable": ResultNotPicklable, "exited": RankCrashed,
           "signaled": RankCrashed, "hung": JobTimeout}[first.status]
    lines = [first.describe()]
    others = [r for r in result.ranks if r is not first]
    lines += ["  " + r.describe() for r in others if not r.ok]
    ok = [r.rank for r in others if r.ok]
    if ok:
        lines.append(f"  rank{'s' * (len(ok) > 1)} {', '.join(map(str, ok))} returned normally")
    if first.status == "hung":
        lines.append("Hint: a rank waiting in a collective usually means another rank never called "
                     "it (a collective under `if rank == 0:`, mismatched collectives, an early "
                     "return). If the work is only slow, pass a larger timeout=.")
    elif first.status == "signaled":
        hint = _HINTS.get(first.signal, "see the rank's stderr above.")
        if isinstance(hint, dict):                # "cpu:gloo,cuda:nccl" maps to NCCL's hint
            hint = hint["nccl" if "nccl" in result.backend else "gloo"]
        lines.append("Hint: " + hint)
    elif first.status == "exited":
        lines.append("Hint: os._exit()/sys.exit() in the function, or a crash; see its stderr.")
    elif first.status == "unpicklable":
        lines.append("Hint: return plain Python values, tensors, or lists/dicts of them (not "
                     "objects of classes defined inside the function).")
    lines.append("Details per rank: err.result (a JobResult); rank outputs are printed above.")
    err = cls("\n".join(lines), result)
    if first.traceback:
        err.__cause__ = RemoteTraceback(f"Traceback of rank {first.rank}:\n{first.traceback}")
    return err
