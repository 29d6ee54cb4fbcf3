"""Scoring an answer against its bank question: the one engine behind checks, forms and grades.

:func:`score` is what :func:`labkit.grading.quiz.check`, the quiz form and the grader all call,
so they cannot disagree. Answer kinds (single, multi, numeric, short) are matched here;
exercises go to their checker through :func:`labkit.grading.exercise.evaluate`. Accepted
answer forms are listed in :mod:`labkit.grading.quiz`.
"""
from __future__ import annotations

import math
import re
from typing import Any

from .bank import Question, find, resolve
from .exercise import evaluate
from .score import Score, fmt

__all__ = ["score"]


def score(question: Question | str, answer: Any, inputs: dict | None = None) -> Score:
    """Score an answer without printing (what the grader calls). Never raises for bad answers.

    >>> score("03.ring_steps", 5).status
    'wrong'
    """
    q = find(question) if isinstance(question, str) else question
    if q.kind == "exercise":
        return evaluate(q, answer)
    if answer is None:
        return _score(q, 0.0, "unanswered", f"not answered yet: set {q.variable} = ... and run "
                      f"the cell again", None, explain=False)
    expected, problem = _expected(q, inputs or {})
    if problem:
        return _score(q, 0.0, "error", problem, answer, explain=False)
    try:
        ok, shown = _MATCH[q.kind](q, answer, expected)
    except _Invalid as exc:
        return _score(q, 0.0, "wrong", str(exc), answer, explain=False)
    except Exception as exc:  # noqa: BLE001  (an answer object whose == or str() raises)
        return _score(q, 0.0, "wrong", f"this answer cannot be read: {type(exc).__name__}",
                      None, explain=False)
    if ok:
        return _score(q, q.points, "correct", "correct", shown)
    feedback = f"not quite: you answered {shown}"
    if q.hint:
        feedback += f". Hint: {q.hint}"
    return _score(q, 0.0, "wrong", feedback, shown)

class _Invalid(ValueError):
    """An answer in a form the question cannot read (the message says which forms it takes)."""


def _score(q: Question, points: float, status: str, feedback: str, shown: Any,
           explain: bool = True) -> Score:
    return Score(q.id, points, q.points, status, feedback,
                 None if shown is None else str(shown)[:200],
                 q.explanation if explain else "")


def _expected(q: Question, inputs: dict) -> tuple[Any, str | None]:
    """The right answer: fixed in the bank, or computed by the key from the notebook's inputs."""
    if q.key is None:
        return q.answer, None
    missing = [n for n in q.inputs if inputs.get(n) is None]
    if missing:
        return None, (f"cannot be checked yet: it needs your variable {missing[0]!r}; run the "
                      f"cell that defines it first")
    try:
        value = resolve(q.key, q.source)(**{n: inputs[n] for n in q.inputs})
    except Exception as exc:  # noqa: BLE001  (a key that rejects the inputs explains why)
        return None, f"the answer could not be computed from your {', '.join(q.inputs)}: " \
                     f"{type(exc).__name__}: {exc}"
    return value, None


def _match_single(q: Question, answer: Any, expected: str) -> tuple[bool, str]:
    idx = _choice_index(q, answer)
    return q.choices[idx] == expected, f"{q.letters[idx]}) {q.choices[idx]}"


def _match_multi(q: Question, answer: Any, expected: list) -> tuple[bool, str]:
    if isinstance(answer, str):
        parts = [p for p in re.split(r"[,\s]+", answer.strip()) if p]
        if len(parts) == 1 and parts[0].isalpha() and set(parts[0].lower()) <= set(q.letters) \
                and _norm(parts[0]) not in map(_norm, q.choices):
            parts = list(parts[0])
    elif isinstance(answer, (list, tuple, set, frozenset)):
        parts = list(answer)
    else:
        raise _Invalid(f"answer with letters like 'ac' or a list like ['a', 'c'], "
                       f"not {type(answer).__name__}")
    picked = sorted({_choice_index(q, p) for p in parts})
    shown = ", ".join(q.letters[i] for i in picked) or "nothing"
    return {q.choices[i] for i in picked} == set(expected), shown


def _match_numeric(q: Question, answer: Any, expected: Any) -> tuple[bool, str]:
    if isinstance(answer, bool) or isinstance(answer, (list, tuple, dict, set)):
        raise _Invalid(f"answer with a number, not {type(answer).__name__}")
    try:
        x = float(answer.item() if hasattr(answer, "item") else answer)
    except Exception:  # noqa: BLE001  (arrays, tensors of many elements, odd objects)
        raise _Invalid(f"answer with one number, not {answer!r:.60}") from None
    e = float(expected)
    ok = math.isfinite(x) and math.isclose(x, e, abs_tol=q.tolerance,
                                           rel_tol=max(q.rel_tolerance, 1e-9))
    return ok, fmt(x)


def _match_short(q: Question, answer: Any, expected: Any) -> tuple[bool, str]:
    if not isinstance(answer, str):
        raise _Invalid(f"answer with text in quotes, not {type(answer).__name__}")
    accepted = [expected] if isinstance(expected, str) else list(expected)
    return _norm(answer) in {_norm(a) for a in accepted}, repr(answer.strip())


_MATCH = {"single": _match_single, "multi": _match_multi, "numeric": _match_numeric,
          "short": _match_short}


def _choice_index(q: Question, answer: Any) -> int:
    if isinstance(answer, str):
        text = answer.strip()
        letter = text.lower().strip("()").rstrip(")")
        if len(letter) == 1 and letter in q.letters:
            return q.letters.index(letter)
        norms = [_norm(c) for c in q.choices]
        if _norm(text) in norms:
            return norms.index(_norm(text))
    raise _Invalid(f"{answer!r:.60} is not one of the choices: answer with a letter "
                   f"{'/'.join(q.letters)} or the text of a choice")


def _norm(text: str) -> str:
    return " ".join(str(text).casefold().split()).strip().rstrip(".").strip("'\"` ")
