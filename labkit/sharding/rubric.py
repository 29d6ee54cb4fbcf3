"""The Evaluation section: what the grader would give for the answers in the notebook now (§ Evaluation).

The grader (:mod:`labkit.grade`) reads each question's variable from the kernel and scores it
with the bank; :func:`grader_score` does the same with the notebook's namespace, and takes the
exercise scores already computed by ``lk.exercise.check`` (so no checker runs twice).

Example (last cell of notebook 06)::

    lk.sharding.rubric.grader_score(globals(), [ex1, ex2, ex3])
"""
from __future__ import annotations

from .. import quiz

__all__ = ["grader_score"]


def grader_score(namespace: dict, exercise_scores=(), bank: str = "06_sharding") -> float:
    """Print one line per graded item (id, points, status) and the total; return the points."""
    done = {s.id: s for s in exercise_scores if s is not None}
    total = earned = 0.0
    lines = []
    for q in quiz.load_bank(quiz.bank_dir() / f"{bank}.toml").questions.values():
        if q.kind == "exercise":
            s = done.get(q.id) or quiz.Score(q.id, 0.0, q.points, "unanswered", "not checked yet")
        else:
            inputs = {name: namespace.get(name) for name in q.inputs}
            s = quiz.score(q, namespace.get(q.variable), inputs)
        total += q.points
        earned += s.points
        lines.append(f"  {q.id:<28} {s.points:>4g} / {q.points:<3g} {s.status}")
    print("\n".join(lines))
    print(f"score the grader would give now: {earned:g} / {total:g}")
    return earned
