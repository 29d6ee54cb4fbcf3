"""The answer a diagnosis gives: a :class:`Verdict` (what went wrong, where, why, the fix).

Shared by :mod:`labkit.diagnosis.diagnose` (failed jobs) and :mod:`labkit.diagnosis.replicas`
(silent disagreement between ranks). ``print(verdict)`` shows a headline, one
line per rank, the cause and the fix; the fields are there for code and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["KINDS", "RankFinding", "Verdict"]

KINDS = {
    "ok": "no failure and no sign of a problem",
    "missing_rank": "a rank never reached a collective the others were waiting in",
    "mismatch": "ranks called different collectives at the same point",
    "size_mismatch": "ranks passed tensors of different size or dtype to one collective",
    "crash": "a rank process died; the others only saw it go",
    "error": "a rank raised an exception in its own code; the others only saw it go",
    "unused_parameters": "DDP found parameters that received no gradient",
    "replicas_diverged": "replicas hold different parameters or buffers",
    "data_sharding": "ranks saw overlapping data, or the same order every epoch",
    "hang": "ranks were stuck with no error and no clear culprit",
}


@dataclass
class RankFinding:
    """What one rank did: ``state`` is ok, raised, crashed, hung, timed out or echo."""

    rank: int
    state: str
    detail: str
    collective: str | None = None   # the collective the rank was in, e.g. "all_reduce"
    where: str | None = None        # its own line of code, e.g. "step (line 5: dist.all_reduce(t))"
    at: tuple[str, int] | None = field(default=None, repr=False)  # (file, line) of that code

    def line(self) -> str:
        at = f" in {self.collective}" if self.collective else ""
        where = f" at {self.where}" if self.where else ""
        return f"rank {self.rank}: {self.state}{at}{where} - {self.detail}"


@dataclass(repr=False)
class Verdict:
    """A short answer a learner can act on. Print it, or read the fields.

    ``kind`` is one of :data:`KINDS`; ``culprits`` the ranks most likely at
    fault; ``collective`` and ``seq`` (the process group's collective number)
    where known; ``cause`` and ``fix`` in words; ``ranks`` one finding per rank.
    """

    kind: str
    headline: str
    culprits: list[int] = field(default_factory=list)
    collective: str | None = None
    seq: int | None = None
    cause: str = ""
    fix: str = ""
    ranks: list[RankFinding] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def where(self) -> dict[int, str]:
        """Rank -> its line of code, for every rank where it is known."""
        return {f.rank: f.where for f in self.ranks if f.where}

    def text(self) -> str:
        lines = [f"Verdict: {self.kind} - {self.headline}"]
        if self.collective:
            lines.append(f"Collective: {self.collective}" +
                         (f" (sequence number {self.seq} in the process group)"
                          if self.seq is not None else ""))
        lines += ["  " + f.line() for f in self.ranks] + ["  " + d for d in self.details]
        if self.cause:
            lines.append(f"Cause: {self.cause}")
        if self.fix:
            lines.append(f"Fix: {self.fix}")
        return "\n".join(lines)

    __str__ = __repr__ = text


