"""What a job hands back: one :class:`RankResult` per rank, gathered in a :class:`JobResult`.

Everything here was produced by real processes: return values, captured
stdout/stderr (Python and C++ alike, captured at the file-descriptor level),
wall time of the function on each rank, and for failed ranks the exception,
exit code, signal or stack.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RankResult", "JobResult", "STATUSES", "ECHOES", "TIMEOUTS", "error_kind"]

STATUSES = {
    "ok": "returned a value",
    "raised": "raised an exception",
    "unpicklable": "returned a value that cannot be pickled",
    "exited": "exited before returning",
    "signaled": "was killed by a signal",
    "hung": "was still running when the job was stopped",
}


@dataclass
class RankResult:
    """The outcome of one rank. ``status`` is one of :data:`STATUSES`."""

    rank: int
    status: str = "hung"
    value: Any = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float | None = None
    error: str | None = None       # one line, e.g. "ValueError: boom"
    traceback: str | None = None   # the remote traceback of a raising rank
    exitcode: int | None = None    # for "exited"
    signal: str | None = None      # for "signaled", e.g. "SIGKILL"
    stack: str | None = None       # for "hung": the Python stack dump
    where: str | None = None       # for "hung": one line, where it was stuck
    pid: int | None = None
    t_fail: float | None = None    # time.time() of the failure, to find the first one
    trace: list | None = None      # lk.run(..., trace=True): this rank's collectives (commtrace)
    trace_dropped: int = 0         # records beyond the recorder's cap

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        """One line for error messages: what happened to this rank."""
        if self.status in ("raised", "unpicklable"):
            return f"rank {self.rank} {self.error}" if self.status == "unpicklable" \
                else f"rank {self.rank} raised {self.error}"
        if self.status == "exited":
            return f"rank {self.rank} exited with code {self.exitcode} before returning"
        if self.status == "signaled":
            tail = _last_line(self.stderr)
            return f"rank {self.rank} was killed by {self.signal}" + (f" ({tail})" if tail else "")
        if self.status == "hung":
            return f"rank {self.rank} was stuck in {self.where}"
        return f"rank {self.rank} returned {self.value!r:.60}"


# What a rank's error says about it: a peer vanished under it (an echo of someone else's
# failure), or a collective ran out of time. The runner's ordering below and the diagnosis
# (labkit.diagnosis.findings) read errors with these two lists and nothing else.
ECHOES = ("Connection closed", "Connection reset by peer", "Read error", "Broken pipe",
          "Connection refused", "failed to pass monitoredBarrier, but received errors",
          "received errors while waiting",
          "Connection was likely closed")   # the TCPStore's: rank 0's process (its server) ended
TIMEOUTS = ("Timed out waiting", "timed out", "Socket Timeout", "Timeout waiting")


def error_kind(error: str) -> str:
    """``"echo"`` (a peer's failure seen from here), ``"timed out"``, or ``"raised"``."""
    if any(e in error for e in ECHOES):
        return "echo"
    return "timed out" if any(t in error for t in TIMEOUTS) else "raised"


def _cause_order(r: RankResult) -> int:
    """Crash, own error, a collective's timeout, a peer's vanishing, hung: in that order. A
    rank that timed out waiting explains more than a peer that then saw its connection close
    (that peer can report first: the timed-out rank is still unwinding)."""
    if r.status in ("exited", "signaled"):
        return 0
    if r.status in ("raised", "unpicklable"):
        return {"echo": 3, "timed out": 2, "raised": 1}[error_kind(r.error or "")]
    return 4


def _last_line(text: str) -> str:
    """The most telling line of a crashed rank's stderr (gloo puts its reason there)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "what():" in ln or "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""


@dataclass
class JobResult:
    """Per-rank outcomes of one job, in rank order.

    >>> res = lk.run(step, world_size=4)
    >>> res.values          # what each rank returned
    >>> res.wall_s          # seconds each rank spent in the function
    >>> res[2].stdout       # what rank 2 printed
    """

    world_size: int
    backend: str
    ranks: list[RankResult]
    elapsed_s: float = 0.0   # in the notebook, from the call to the last result
    cold: bool = False       # True when fresh rank processes had to be started
    env: dict = field(default_factory=dict)

    def __getitem__(self, rank: int) -> RankResult:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def values(self) -> list:
        return [r.value for r in self.ranks]

    @property
    def stdout(self) -> list[str]:
        return [r.stdout for r in self.ranks]

    @property
    def stderr(self) -> list[str]:
        return [r.stderr for r in self.ranks]

    @property
    def wall_s(self) -> list[float | None]:
        return [r.wall_s for r in self.ranks]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def trace(self):
        """Every rank's collectives (:class:`~labkit.runtime.commtrace.CommTrace`), or None
        unless the job ran with ``trace=True``. Ranks that hung or died have no records."""
        if all(r.trace is None for r in self.ranks):
            return None
        from .commtrace.view import CommTrace

        return CommTrace([r.trace or [] for r in self.ranks],
                         [r.trace_dropped for r in self.ranks])

    @property
    def failed_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.ok]

    def first_failure(self) -> RankResult | None:
        """The failure most likely to be the cause; the others are usually its echo.

        A crashed rank comes first (its peers then see the connection drop), then a
        rank whose own code raised, then ranks whose collective timed out, then ranks
        that only saw a peer vanish, then hung ranks; ties go to the earliest.
        """
        failed = [r for r in self.ranks if not r.ok]
        if not failed:
            return None
        return min(failed, key=lambda r: (_cause_order(r), r.t_fail or float("inf"), r.rank))

    def summary(self) -> str:
        head = (f"{self.world_size} ranks, backend={self.backend}, "
                f"{'ok' if self.ok else 'FAILED'} in {self.elapsed_s:.3f} s"
                f"{' (cold start)' if self.cold else ''}")
        return "\n".join([head] + ["  " + r.describe() for r in self.ranks])

    def __repr__(self) -> str:
        status = "ok" if self.ok else f"failed ranks {self.failed_ranks}"
        return (f"JobResult(world_size={self.world_size}, backend={self.backend!r}, "
                f"{status}, values={self.values!r:.200})")
