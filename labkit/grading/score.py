"""What an answer scored: the :class:`Score` every check, form and the grader hand back.

One type for quizzes and exercises alike, so the notebook's feedback and the grader's report
always agree (:mod:`labkit.grading.scoring` makes them; :mod:`labkit.grading.quiz` prints them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Score", "STATUSES", "MARKS", "fmt"]

STATUSES = ("correct", "partial", "wrong", "unanswered", "not done", "error")
MARKS = {"correct": "✓", "partial": "◐", "wrong": "✗", "unanswered": "…", "not done": "…",
         "error": "!"}


@dataclass
class Score:
    """How one answer scored: points, a status from :data:`STATUSES`, and feedback text.

    ``cases`` holds the per-case results of an exercise (:class:`labkit.grading.exercise.Case`).
    In a notebook a Score displays nothing (the check already printed); use
    ``.correct``, ``.points`` or ``print(score.text())``.
    """

    id: str
    points: float
    max_points: float
    status: str
    feedback: str
    answer: str | None = None     # short repr of what was answered
    explanation: str = ""
    cases: list = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    def text(self) -> str:
        """The feedback a learner reads: a status line, then cases, hint or explanation."""
        head = (f"{MARKS.get(self.status, '?')} {self.id}: {self.feedback} "
                f"({fmt(self.points)}/{fmt(self.max_points)})")
        lines = [head] + [f"    {'✓' if c.passed else '✗'} {c.name}"
                          + (f": {c.detail}" if c.detail else "") for c in self.cases]
        if self.explanation:
            lines.append(f"  Why: {self.explanation}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)

    def _ipython_display_(self) -> None:  # check() printed already: show nothing twice
        pass

    def __repr__(self) -> str:
        return f"Score({self.id!r}, {fmt(self.points)}/{fmt(self.max_points)}, {self.status!r})"


def fmt(x: float) -> str:
    """A number as a learner reads it: 6 significant digits for floats."""
    return f"{x:.6g}" if isinstance(x, float) else str(x)
