'''Quizzes with immediate feedback, scored the same way in the notebook and by the grader.

Every notebook has a question bank ``quizzes/NN_name.toml`` (ids ``"NN.name"``).
A learner answers in code, ``q_ring_steps = 6``, and ``lk.quiz.check`` prints
feedback at once; the grader (:mod:`labkit.grading.grader`) later reads the same
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
    id = "04.stuck_rank"
    kind = "numeric"
    prompt = "In your `mystery` run, which rank held the others up?"
    variable = "q_stuck_rank"
    key = "labkit.pitfalls.check:mystery_stuck_rank"  # called as key(mystery=...)
    inputs = ["mystery"]              # notebook variables passed to the key, by name

    [[question]]                      # code: see labkit.grading.exercise
    id = "03.ring_all_reduce"
    kind = "exercise"
    prompt = "Write ring_all_reduce(tensor)."
    variable = "ring_all_reduce"      # the learner's function
    checker = "labkit.collectives.check:check_ring_exercise"
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

import sys
from typing import TYPE_CHECKING, Any

from .bank import BankError, Question, bank_dir, find, load_bank
from .context import expect_solved, inputs_for, notebook_ns, variable_note
from .exercise import check as check_exercise
from .score import Score
from .scoring import score

if TYPE_CHECKING:
    from .forms import QuizForm

__all__ = ["check", "ask", "show", "form", "score", "get", "tally", "MISSING"]

MISSING = object()   # "look the variable up in the notebook"


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
    ns = notebook_ns(sys._getframe(1))
    try:
        q = find(qid)
    except BankError as exc:
        print(f"! {qid}: cannot check this question: {exc}")
        return Score(str(qid), 0.0, 0.0, "error", str(exc))
    if answer is MISSING:
        answer = ns.get(q.variable)
    if q.kind == "exercise":
        return check_exercise(qid, answer)
    s = score(q, answer, inputs_for(q, ns, inputs))
    note = variable_note(q, answer, ns)
    print(s.text() + (f"\n  Note: {note}" if note else ""))
    expect_solved(s)
    return s


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


def form(qid: str, **inputs: Any) -> "QuizForm":
    """The :class:`~labkit.grading.forms.QuizForm` behind :func:`ask`, for tests and layouts."""
    from .forms import QuizForm   # ipywidgets only when a form is asked for

    return QuizForm(find(qid), inputs)


def tally(bank: str, exercise_scores=(), namespace: dict | None = None) -> float:
    """Print what the grader would give for the answers in the notebook now, item by item.

    The grader reads each question's variable from the kernel and scores it with the bank;
    this does the same with the notebook's namespace and takes the exercise scores that
    ``lk.exercise.check`` already returned (so no checker runs twice). Returns the points::

        lk.quiz.tally("06_sharding", [ex1, ex2, ex3])     # the Evaluation section's last cell
    """
    ns = notebook_ns(sys._getframe(1)) if namespace is None else namespace
    done = {s.id: s for s in exercise_scores if s is not None}
    total = earned = 0.0
    lines = []
    for q in load_bank(bank_dir() / f"{bank}.toml").questions.values():
        if q.kind == "exercise":
            s = done.get(q.id) or Score(q.id, 0.0, q.points, "unanswered", "not checked yet")
        else:
            s = score(q, ns.get(q.variable), {name: ns.get(name) for name in q.inputs})
        total += q.points
        earned += s.points
        lines.append(f"  {q.id:<28} {s.points:>4g} / {q.points:<3g} {s.status}")
    print("\n".join(lines))
    print(f"score the grader would give now: {earned:g} / {total:g}")
    return earned
