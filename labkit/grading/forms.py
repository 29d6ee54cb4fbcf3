"""The ipywidgets form behind ``lk.quiz.ask``: choices or a text box, Submit, feedback.

Scoring is :func:`labkit.grading.scoring.score`, the grader's own function, so the form
and the grade never disagree. The form is for practice: the grader reads the
question's notebook variable, so the feedback shows the line that records the
answer. Only plain widgets (no ``Output``), so nbval and static exports are
quiet; callbacks are testable without a kernel::

    f = lk.quiz.form("03.ring_steps")
    f.set_answer("6"); f.submit().status      # 'correct'
    f.feedback.value                          # the HTML the learner sees

CSS classes for browser tests: ``labkit-quiz`` (the form),
``labkit-quiz-submit`` (the button), ``labkit-quiz-feedback`` (the feedback).
"""
from __future__ import annotations

import html
import re
from typing import Any

import ipywidgets as W

from .bank import Question
from .context import notebook_ns
from .scoring import score

__all__ = ["QuizForm"]

_COLOR = {"correct": "#1a7f37", "partial": "#9a6700", "wrong": "#cf222e"}


class QuizForm:
    """One question as a form; ``widget`` is what :func:`labkit.grading.quiz.ask` displays."""

    def __init__(self, question: Question, inputs: dict | None = None):
        self.question = q = question
        self.inputs = dict(inputs or {})
        self.last = None   # the last Score
        prompt = W.HTMLMath(f"<b>{html.escape(q.id)}</b> ({_pts(q.points)})&nbsp; {_md(q.prompt)}")
        self.boxes: list[W.Checkbox] = []
        if q.kind == "single":
            self.input = W.RadioButtons(options=[(f"{l}) {_plain(c)}", l) for l, c in
                                                 zip(q.letters, q.choices)], value=None,
                                        layout=W.Layout(width="auto"))
        elif q.kind == "multi":
            self.boxes = [W.Checkbox(False, description=f"{l}) {_plain(c)}", indent=False,
                                     layout=W.Layout(width="auto"))
                          for l, c in zip(q.letters, q.choices)]
            self.input = W.VBox(self.boxes)
        elif q.kind in ("numeric", "short"):
            self.input = W.Text(placeholder="a number" if q.kind == "numeric" else "your answer")
        else:
            self.input = W.HTML(f"A code exercise: write <code>{q.variable}</code>, then run "
                                f"<code>lk.exercise.check(\"{q.id}\", {q.variable})</code>.")
        self.button = W.Button(description="Submit", button_style="primary",
                               disabled=q.kind == "exercise")
        self.button.add_class("labkit-quiz-submit")
        self.button.on_click(lambda _b: self.submit())
        self.feedback = W.HTML("")
        self.feedback.add_class("labkit-quiz-feedback")
        self.widget = W.VBox([W.HTML(_STYLE), prompt, self.input, self.button, self.feedback])
        self.widget.add_class("labkit-quiz")

    def answer(self) -> Any:
        """The answer the form holds now, in the form :func:`labkit.grading.scoring.score` takes."""
        q = self.question
        if q.kind == "single":
            return self.input.value
        if q.kind == "multi":
            picked = [l for l, box in zip(q.letters, self.boxes) if box.value]
            return picked or None
        if q.kind in ("numeric", "short"):
            return self.input.value.strip() or None
        return None

    def set_answer(self, value: Any) -> None:
        """Fill the form (tests, demos): a letter, letters, or text."""
        q = self.question
        if q.kind == "single":
            self.input.value = value
        elif q.kind == "multi":
            for l, box in zip(q.letters, self.boxes):
                box.value = l in value
        elif q.kind in ("numeric", "short"):
            self.input.value = str(value)

    def submit(self):
        """Score the form's answer and show the feedback; returns the :class:`Score`."""
        q = self.question
        ns = notebook_ns(None)
        inputs = {n: self.inputs.get(n, ns.get(n)) for n in q.inputs}
        answer = self.answer()
        if q.kind == "numeric" and answer is not None:
            try:
                answer = float(answer)
            except ValueError:
                pass   # score() explains what a numeric answer looks like
        self.last = s = score(q, answer, inputs)
        color = _COLOR.get(s.status, "#57606a")
        head = s.feedback if s.feedback.startswith(s.status) else f"{s.status}: {s.feedback}"
        parts = [f'<div style="color:{color}"><b>{html.escape(head)}</b> '
                 f'({s.points:g}/{s.max_points:g})</div>']
        if s.explanation:
            parts.append(f"<div><b>Why:</b> {_md(s.explanation)}</div>")
        if answer is not None and s.status != "error":
            parts.append(f"<div style='color:#57606a'>To have it graded, write "
                         f"<code>{q.variable} = {html.escape(repr(answer))}</code> in the "
                         f"answer cell.</div>")
        self.feedback.value = "".join(parts)
        return s


def _md(text: str) -> str:
    """Escape HTML, keep `code` and **bold** (prompts are short markdown)."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


def _pts(x: float) -> str:
    return f"{x:g} point{'s' * (x != 1)}" if x else "0"


def _plain(text: str) -> str:
    """Choice labels are plain text in widgets: drop Markdown's code backticks."""
    return text.replace("`", "")


# ipywidgets gives every radio/checkbox label one fixed line: a long choice then runs over the
# next one. Let the labels wrap (scoped to quiz forms).
_STYLE = """<style>
.labkit-quiz .widget-radio-box label, .labkit-quiz .widget-checkbox label {
  height: auto !important; white-space: normal !important; line-height: 1.35;
  padding: 2px 0; align-items: flex-start; }
.labkit-quiz .widget-radio-box, .labkit-quiz .widget-checkbox { height: auto !important; }
.labkit-quiz .widget-radio-box input, .labkit-quiz .widget-checkbox input { margin-top: 3px; }
</style>"""
