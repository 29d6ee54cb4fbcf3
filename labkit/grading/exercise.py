'''Code exercises: the learner writes a function, real multi-process runs check it case by case.

An exercise is a ``kind = "exercise"`` question in the notebook's bank
(:mod:`labkit.grading.quiz` shows the format) that names the learner's function
(``variable``) and a **checker** (``checker = "labkit.collectives.check:check_ring_exercise"``).
In the notebook::

    def ring_all_reduce(tensor):
        ...                                         # the learner's code
    lk.exercise.check("03.ring_all_reduce", ring_all_reduce)
    # ✗ 03.ring_all_reduce: 4 of 6 cases pass (2/3)
    #     ✓ 2 ranks, 8 elements
    #     ✗ 3 ranks, 7 elements: rank 2 got [...], expected [...]

``check`` prints and never raises. A stub that raises ``NotImplementedError``
(directly, or inside a rank: a :class:`labkit.RankError` whose rank error starts
with "NotImplementedError") reports "not done yet", so an untouched student
notebook runs top to bottom. The grader calls :func:`evaluate` with the same
checker on the function it collected from the kernel. Score: ``points * passed
cases / all cases`` (``partial = false`` in the bank: all or nothing).

How to write a checker
----------------------
A checker is a plain function in a lesson's ``check`` package, ``check_x(fn) -> list[Case]``:

1. Run the learner's ``fn`` the way the lesson uses it, on real ranks with
   ``lk.run(..., timeout=5, deadline=..., echo=False)``: short limits, so a
   deadlocked answer fails one case fast instead of hanging the grader.
2. Compare with an oracle (``dist.all_reduce``, torch DDP, a single-process run),
   on every rank, with awkward inputs (uneven sizes, 1 element, 2-4 ranks).
3. Wrap each scenario in :func:`case`: a returned string is the pass detail,
   an ``AssertionError`` message is the failure detail (say which rank, what was
   expected, what came back), other exceptions and failed jobs become failed
   cases, and a ``NotImplementedError`` stops the check with "not done yet".
4. Give nothing away: draw each rank's data (and weights, where the exercise must
   replicate them) from a secret only that rank holds (``os.urandom`` inside the
   rank), have the ranks report it, and build the oracle from the reports after
   they ran. An answer then cannot copy the oracle, read its inputs from the
   checker, or skip the communication. Values may differ between runs; verdicts
   must not (the same answer passes and fails the same cases). A case an answer
   passes idly (nothing to check because it skipped the work) counts for nothing.
   The checker runs in the learner's kernel and in the grader, so it must not
   read notebook globals.

Example::

    def check_sum_ranks(fn) -> list[Case]:
        def on(world_size):
            def test():
                got = lk.run(fn, world_size, timeout=5, echo=False).values
                want = world_size * (world_size + 1) / 2
                assert got == [want] * world_size, f"ranks returned {got}, expected {want} each"
            return test
        return [case(f"{n} ranks", on(n)) for n in (2, 3, 4)]
'''
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..runtime.errors import JobFailed
from .bank import BankError, Question, find, resolve
from .context import expect_solved, notebook_ns
from .score import Score

__all__ = ["Case", "NotDone", "case", "check", "evaluate", "is_not_done", "last_check"]

# exercise id -> (the function checked, its Score): the last check() in this process. The lab's
# own notebooks are graded from these in the test run (:func:`last_check`), never a submission.
_CHECKED: dict[str, tuple[Any, Score]] = {}


@dataclass
class Case:
    """One scenario of a checker: a short ``name``, whether it ``passed``, and a ``detail``."""

    name: str
    passed: bool
    detail: str = ""


class NotDone(Exception):
    """The learner's function is still a stub (it raised ``NotImplementedError``)."""


def case(name: str, test: Callable[[], str | None]) -> Case:
    """Run one scenario of a checker and turn its outcome into a :class:`Case`.

    ``test()`` passes by returning (``None`` or a short detail string) and fails by
    raising ``AssertionError`` (its message is the detail) or any other error
    (a failed ``lk.run`` reads like "rank 1 was stuck in all_reduce ...").
    ``NotImplementedError`` raises :class:`NotDone`, ending the whole check.

    >>> case("2 ranks", lambda: None)
    Case(name='2 ranks', passed=True, detail='')
    """
    try:
        detail = test()
    except AssertionError as exc:
        return Case(name, False, str(exc) or "the result was wrong")
    except Exception as exc:  # noqa: BLE001  (any failure of the learner's code is one failed case)
        if is_not_done(exc):
            raise NotDone(name) from exc
        return Case(name, False, _describe(exc))
    return Case(name, True, "" if detail is None else str(detail))


def is_not_done(exc: BaseException) -> bool:
    """True for ``NotImplementedError``, also when a rank of an ``lk.run`` job raised it."""
    if isinstance(exc, (NotImplementedError, NotDone)):
        return True
    if isinstance(exc, JobFailed) and exc.result is not None:
        return any(r.status == "raised" and (r.error or "").startswith("NotImplementedError")
                   for r in exc.result.ranks)
    return False


def check(exercise_id: str, fn: Any = None) -> Score:
    """Run the exercise's checker on ``fn`` and print a per-case report; never raises.

    Args:
        exercise_id: the exercise's id in its bank, e.g. ``"03.ring_all_reduce"``.
        fn: the learner's function (default: the bank's ``variable`` in the notebook).

    Returns the :class:`~labkit.grading.score.Score` (``.cases`` holds the :class:`Case` list).
    """
    try:
        q = find(exercise_id)
    except BankError as exc:
        print(f"! {exercise_id}: cannot check this exercise: {exc}")
        return Score(str(exercise_id), 0.0, 0.0, "error", str(exc))
    if fn is None:
        fn = notebook_ns(sys._getframe(1)).get(q.variable)
    s = evaluate(q, fn)
    _CHECKED[q.id] = (fn, s)
    print(s.text())
    expect_solved(s)
    return s


def last_check(exercise_id: str, fn: Any) -> Score | None:
    """The Score of this process's last :func:`check` of ``exercise_id``, if it checked this
    very object ``fn`` (not an equal one, not a later redefinition); else None."""
    seen, s = _CHECKED.get(exercise_id, (None, None))
    return s if s is not None and fn is not None and seen is fn else None


def evaluate(question: Question | str, fn: Any) -> Score:
    """Score ``fn`` with the question's checker without printing (what the grader calls).

    Never raises for a wrong or crashing answer: the Score says what happened.
    """
    q = find(question) if isinstance(question, str) else question

    def result(points: float, status: str, feedback: str, cases=()) -> Score:
        return Score(q.id, points, q.points, status, feedback,
                     None if fn is None else getattr(fn, "__name__", type(fn).__name__),
                     q.explanation if status in ("correct", "partial") else "", list(cases))

    if fn is None:
        return result(0.0, "unanswered", f"not answered yet: define {q.variable} and run its cell")
    if not callable(fn):
        return result(0.0, "wrong", f"{q.variable} must be a function, got {type(fn).__name__}")
    try:
        checker = resolve(q.checker, q.source)
    except Exception as exc:  # noqa: BLE001  (a broken bank must not take the notebook down)
        return result(0.0, "error", f"the checker {q.checker} cannot be loaded: "
                                    f"{type(exc).__name__}: {exc}")
    try:
        cases = checker(fn)
    except Exception as exc:  # noqa: BLE001
        if is_not_done(exc):
            return result(0.0, "not done", _NOT_DONE.format(v=q.variable))
        return result(0.0, "error", f"the check stopped: {_describe(exc)}. Try your function on "
                                    f"a small example to see why.")
    if not isinstance(cases, list) or not cases or not all(isinstance(c, Case) for c in cases):
        return result(0.0, "error", f"checker {q.checker} returned {type(cases).__name__}, not "
                                    f"a non-empty list of Case (a bug in the checker, not in "
                                    f"your code)")
    passed = sum(c.passed for c in cases)
    if passed == 0 and all(c.detail.startswith("NotImplementedError") for c in cases):
        return result(0.0, "not done", _NOT_DONE.format(v=q.variable))
    if passed == len(cases):
        return result(q.points, "correct", f"all {len(cases)} cases pass", cases)
    points = q.points * passed / len(cases) if q.partial else 0.0
    status = "partial" if passed and q.partial else "wrong"
    return result(points, status, f"{passed} of {len(cases)} cases pass", cases)


_NOT_DONE = ("not done yet: {v} still raises NotImplementedError. Write it, run its cell, "
             "and check again")


def _describe(exc: BaseException) -> str:
    """One or a few lines that say what went wrong, for a case detail."""
    if isinstance(exc, JobFailed):
        lines = [ln for ln in str(exc).splitlines() if ln.strip()
                 and not ln.startswith("Details per rank")]
        return "; ".join(ln.strip() for ln in lines[:4])
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
