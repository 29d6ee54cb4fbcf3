"""Scoring an answer against its bank question: the one engine behind checks, forms and grades.

:func:`score` is what :func:`labkit.grading.quiz.check`, the quiz form and the grader all call,
so they cannot disagree. Answer kinds (single, multi, numeric, short) are matched here;
exercises go to their checker through :func:`labkit.grading.exercise.evaluate`. Accepted
answer forms are listed in :mod:`labkit.grading.quiz`.

What the grader collected from a kernel is scored on one path too: :func:`score_collected`
(a value that was lost, failed to collect, is missing, or is there), under a time limit for
checkers and keys, for plain answers in the grader and for objects wherever they are loaded
(:func:`score_objects`: the checker process of :mod:`labkit.grading.sandbox`, or this process
for the lab's own notebooks).
"""
from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
from typing import Any, Iterable, Iterator

from .bank import Question, find, resolve
from .exercise import evaluate
from .score import Score, fmt

__all__ = ["score", "score_collected", "score_objects", "KEY_TIMEOUT_S"]

KEY_TIMEOUT_S = 60.0     # a quiz key is quick; an exercise gets the grader's check timeout


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

def score_collected(q: Question, state: str, value: Any, inputs: dict | None = None,
                    limit: float = 0.0) -> Score:
    """Score what the grader collected for ``q``: ``state`` is ``ok`` (``value`` is the answer),
    ``missing`` (the notebook never defines it), ``lost`` (nothing could be collected),
    ``error`` (``value`` says why) or ``pickle`` (an object, here where only plain data is
    scored). The check runs under ``limit`` seconds (0: none; SIGALRM, main thread only), and a
    checker or key that fails is an error Score, never an exception."""
    if state == "lost":
        return Score(q.id, 0.0, q.points, "error", "not graded: the answers could not be "
                     "collected from the kernel (see the notes)")
    if state in ("error", "pickle"):
        why = value if state == "error" else "it is not plain data"
        return Score(q.id, 0.0, q.points, "error", f"{q.variable} could not be collected: {why}")
    try:
        with _time_limit(limit):
            s = score(q, value if state == "ok" else None, inputs or {})
    except _CheckTimeout:
        return Score(q.id, 0.0, q.points, "error", f"the check ran past {limit:g} s and was "
                     f"stopped (an endless loop or a deadlock in {q.variable}?)")
    except Exception as exc:  # noqa: BLE001  (a key or checker bug must not stop the gradebook)
        return Score(q.id, 0.0, q.points, "error", f"the check failed: {type(exc).__name__}: {exc}")
    if state == "missing":
        s.feedback = f"not answered: the notebook never defines {q.variable}"
    return s


def score_objects(questions: Iterable[Question], collected: dict[str, tuple[str, Any]],
                  check_timeout: float, checked: dict[str, Score] | None = None,
                  key_timeout: float = KEY_TIMEOUT_S) -> Iterator[Score]:
    """Score questions that run the submission's objects (exercises, computed keys) in THIS
    process, loading the pickles collected: what the checker process does
    (:mod:`labkit.grading.sandbox`), and the grader's path for the lab's own notebooks only
    (``trusted``), never for a submission. An exercise in ``checked`` (scored by the
    notebook's own check cell, on the very function collected) keeps that Score. An exercise
    check runs under ``check_timeout`` seconds, a computed key under ``key_timeout``."""
    checked = checked or {}
    for q in questions:
        if q.id in checked:
            yield checked[q.id]
            continue
        state, value = _load(collected, q.variable)
        inputs = {name: v if s == "ok" else None
                  for name, (s, v) in ((n, _load(collected, n)) for n in q.inputs)}
        yield score_collected(q, state, value, inputs,
                              check_timeout if q.kind == "exercise" else key_timeout)


def _load(collected: dict, name: str) -> tuple[str, Any]:
    state, data = collected.get(name, ("lost", ""))
    if state != "pickle":
        return state, data
    import cloudpickle

    try:
        return "ok", cloudpickle.loads(data)
    except Exception as exc:  # noqa: BLE001
        return "error", f"could not be loaded: {type(exc).__name__}: {exc}"


class _CheckTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that checkers' ``except Exception`` let it through."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def alarm(_sig, _frame):
        raise _CheckTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


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
