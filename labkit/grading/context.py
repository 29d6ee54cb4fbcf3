"""The notebook side of checking: the learner's variables, and the solved-notebook switch.

A check called in a notebook looks answers up in the learner's namespace (the caller's globals,
else IPython's user namespace); ``LABKIT_EXPECT_SOLVED=1`` (set for ``solutions/`` by the
pytest plugin) turns any check that is not correct into an error, so a solved notebook cannot
quietly carry a wrong answer.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from .bank import Question
from .score import Score

__all__ = ["notebook_ns", "inputs_for", "variable_note", "expect_solved"]


def notebook_ns(frame) -> dict:
    """The learner's variables: the caller's globals, else the IPython user namespace."""
    ns = dict(frame.f_globals) if frame is not None else {}
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        ip = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if ip is not None:
        ns = {**ip.user_ns, **ns}
    return ns


def inputs_for(q: Question, ns: dict, given: dict) -> dict:
    return {name: given.get(name, ns.get(name)) for name in q.inputs}


def variable_note(q: Question, answer: Any, ns: dict) -> str:
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


def expect_solved(s: Score) -> None:
    """Author tool: LABKIT_EXPECT_SOLVED=1 turns a non-correct check into an AssertionError."""
    if os.environ.get("LABKIT_EXPECT_SOLVED") == "1" and not s.correct:
        raise AssertionError(f"LABKIT_EXPECT_SOLVED=1 and {s.id} is {s.status}: {s.feedback}")
