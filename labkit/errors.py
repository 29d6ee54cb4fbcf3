"""The errors labkit raises, and why each one is a lesson.

Every error names what happened, which rank, and what to do next. A job that
fails raises a :class:`JobFailed` subclass carrying the whole
:class:`~labkit.result.JobResult` (``err.result``), so a notebook can inspect
per-rank output, stacks and exit codes after the fact. The remote traceback of
the first rank that raised is attached as ``__cause__`` (as joblib/loky do).

Hierarchy::

    LabkitError
    ├── InvalidJob          (also ValueError)  bad arguments, nothing was started
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
]


class LabkitError(Exception):
    """Base class of every error labkit raises on purpose."""


class InvalidJob(LabkitError, ValueError):
    """The job was rejected before any process was started."""


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

    ``result`` is the full :class:`~labkit.result.JobResult`: every rank's
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
