'''Quizzes with immediate feedback, scored the same way in the notebook and by the grader.

Every notebook has a question bank ``quizzes/NN_name.toml`` (ids ``"NN.name"``).
A learner answers in code, ``q_ring_steps = 6``, and ``lk.quiz.check`` prints
feedback at once; the grader (:mod:`labkit.grade`) later reads the same
variable from the kernel and scores it with the bank, never with the
notebook's own output. ``lk.quiz.ask`` shows the same question as a form.

Bank format (TOML, one ``[[question]]`` table per question)::

    [[question]]
    id = "03.ring_steps"              # "NN." + a name; NN = the notebook number
    kind = "numeric"                  # single | multi | numeric | short | exercise
    prompt = "How many steps does a ring all-reduce take on 4 ranks?"
    variable = "q_ring_steps"         # the notebook variable that holds the answer
    answer = 6
    tolerance = 0                     # numeric: accepted if |x - answer| <= tolerance
    rel_tolerance = 0.0               #   ... or <= rel_tolerance * |answer|
    points = 1                        # default 1
    explanation = "N-1 reduce-scatter steps + N-1 all-gather steps = 2(N-1) = 6."
    hint = "Count the two phases separately."   # optional, shown after a wrong answer

    [[question]]
    id = "03.busbw"
    kind = "single"
    prompt = "Which number compares fairly across world sizes?"
    variable = "q_busbw"
    choices = ["algbw", "busbw", "wall time"]
    answer = "busbw"                  # the text of the right choice (multi: a list of texts)

    [[question]]                      # computed from the learner's own run
    id = "03.rank2_bytes"
    kind = "numeric"
    prompt = "How many bytes did rank 2 send in your ring run?"
    variable = "q_rank2_bytes"
    key = "labkit.collectives:expected_bytes"   # called as key(trace=<the notebook's trace>)
    inputs = ["trace"]                # notebook variables passed to the key, by name

    [[question]]                      # code: see labkit.exercise
    id = "03.ring_all_reduce"
    kind = "exercise"
    prompt = "Write ring_all_reduce(tensor)."
    variable = "ring_all_reduce"      # the learner's function
    checker = "labkit.collectives:check_ring_exercise"
    points = 3                        # partial credit: points * passed cases / all cases

Answers: single: the letter (``"b"``) or the choice's text; multi: letters
(``"ac"``, ``"a, c"``) or a list of letters/texts; numeric: a number (numpy and
0-d torch values too); short: text, compared ignoring case, spaces and a final
full stop (``answer`` may list several accepted texts). ``None`` means "not
answered yet". Fields ``key`` and ``checker`` may also name ``"file.py:function"``
next to the bank. ``$LABKIT_QUIZ_DIR`` points at another folder of banks.

In a notebook::

    q_ring_steps = 6                              # the graded answer
    lk.quiz.check("03.ring_steps", q_ring_steps)  # prints feedback, never raises
    lk.quiz.ask("03.ring_steps")                  # the same question as a form
'''
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from ._bank import BankError, Question, all_banks, bank_dir, find, load_bank, resolve

__all__ = ["Score", "Question", "BankError", "check", "ask", "show", "form", "score", "get",
           "load_bank", "all_banks", "bank_dir", "MISSING"]

MISSING = object()   # "look the variable up in the notebook"
STATUSES = ("correct", "partial", "wrong", "unanswered", "not done", "error")
_MARK = {"correct": "✓", "partial": "◐", "wrong": "✗", "unanswered": "…", "not done": "…",
         "error": "!"}


@dataclass
class Score:
    """How one answer scored: points, a status from :data:`STATUSES`, and feedback text.

    ``cases`` holds the per-case results of an exercise (:class:`labkit.exercise.Case`).
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
        head = (f"{_MARK.get(self.status, '?')} {self.id}: {self.feedback} "
                f"({_fmt(self.points)}/{_fmt(self.max_points)})")
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
        return f"Score({self.id!r}, {_fmt(self.points)}/{_fmt(self.max_points)}, {self.status!r})"


def get(qid: str) -> Question:
    """The question ``qid`` from its bank, e.g. ``lk.quiz.get("03.ring_steps").prompt``."""
    return find(qid)


def check(qid: str, answer: Any = MISSING, **inputs: Any) -> Score:
    """Score ``answer`` to question ``qid`` and print feedback at once; never raises.

    Args:
        qid: the question id, e.g. ``"03.ring_steps"``.
        answer: the learner's answer; omitted: the question's variable in the notebook.
        inputs: values for a computed question's key (default: the notebook variables
            named in the bank's ``inputs``).

    Example::

        q_ring_steps = 6
        lk.quiz.check("03.ring_steps", q_ring_steps)
        # ✓ 03.ring_steps: correct (1/1)
        #   Why: N-1 reduce-scatter steps + N-1 all-gather steps = 2(N-1) = 6.
    """
    ns = _notebook_ns(sys._getframe(1))
    try:
        q = find(qid)
    except BankError as exc:
        print(f"! {qid}: cannot check this question: {exc}")
        return Score(str(qid), 0.0, 0.0, "error", str(exc))
    if answer is MISSING:
        answer = ns.get(q.variable)
    if q.kind == "exercise":
        from . import exercise
        return exercise.check(qid, answer)
    s = score(q, answer, _inputs_for(q, ns, inputs))
    note = _variable_note(q, answer, ns)
    print(s.text() + (f"\n  Note: {note}" if note else ""))
    _expect_solved(s)
    return s


def score(question: Question | str, answer: Any, inputs: dict | None = None) -> Score:
    """Score an answer without printing (what the grader calls). Never raises for bad answers.

    >>> lk.quiz.score("03.ring_steps", 5).status
    'wrong'
    """
    q = find(question) if isinstance(question, str) else question
    if q.kind == "exercise":
        from . import exercise
        return exercise.evaluate(q, answer)
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


def ask(qid: str, **inputs: Any) -> None:
    """Show question ``qid`` as a form (choices or a text box, Submit, feedback, explanation).

    The form is for practice: the grader reads the question's variable, and the
    feedback says which line to write for the answer to count.
    """
    from IPython.display import display

    display(form(qid, **inputs).widget)


def show(*qids: str) -> None:
    """Print questions as text: prompt, lettered choices, and the variable that holds the answer.

    Text survives everywhere (nbval, static exports, a terminal), unlike a form::

        lk.quiz.show("03.ring_steps", "03.why_ring")
    """
    for qid in qids:
        q = find(qid)
        print(f"{q.id} ({q.points:g} point{'s' * (q.points != 1)}) -> set {q.variable}")
        print(f"  {q.prompt}")
        for letter, choice in zip(q.letters, q.choices or ()):
            print(f"    {letter}) {choice}")


def form(qid: str, **inputs: Any):
    """The :class:`labkit._quizform.QuizForm` behind :func:`ask`, for tests and custom layouts."""
    from ._quizform import QuizForm

    return QuizForm(find(qid), inputs)


# ------------------------------------------------------------------ scoring
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
    return ok, _fmt(x)


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


def _fmt(x: float) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


# --------------------------------------------------------- notebook glue
def _notebook_ns(frame) -> dict:
    """The learner's variables: the caller's globals, else the IPython user namespace."""
    ns = dict(frame.f_globals) if frame is not None else {}
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        ip = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if ip is not None:
        ns = {**ip.user_ns, **ns}
    return ns


def _inputs_for(q: Question, ns: dict, given: dict) -> dict:
    return {name: given.get(name, ns.get(name)) for name in q.inputs}


def _variable_note(q: Question, answer: Any, ns: dict) -> str:
    """Warn when the graded variable does not hold the answer just checked."""
    if answer is None or (q.variable in ns and ns[q.variable] is answer):
        return ""
    if q.variable in ns:
        try:
            if bool(ns[q.variable] == answer):
                return ""
        except Exception:  # noqa: BLE001  (tensors and arrays: treat as different)
            pass
    return (f"the grader reads the variable {q.variable}: set {q.variable} = ... so this "
            f"answer counts.")


def _expect_solved(s: Score) -> None:
    """Author tool: LABKIT_EXPECT_SOLVED=1 turns a non-correct check into an AssertionError."""
    if os.environ.get("LABKIT_EXPECT_SOLVED") == "1" and not s.correct:
        raise AssertionError(f"LABKIT_EXPECT_SOLVED=1 and {s.id} is {s.status}: {s.feedback}")
