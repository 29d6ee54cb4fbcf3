"""Rules every lesson notebook follows (CONVENTIONS.md "Notebooks"), checked statically.

* Every quiz question a notebook checks (``lk.quiz.check("NN.x", ...)``) is DISPLAYED — prompt and
  choices, by ``lk.quiz.ask("NN.x")`` or ``lk.quiz.show(..., "NN.x", ...)`` — in the same code cell
  or the code cell right before it; and every question of the notebook's bank is checked in it.
* Every ``##`` heading carries a route tag ``[core · N min]`` or ``[deep dive · N min]``; the core
  path through 00-05 adds up to 65-80 minutes (the seed lesson is 75); the last ``##`` section is
  ``## Evaluation [core · N min]`` and its rubric names every graded item of the bank with its
  points and the notebook's total.
* A core section never uses a name (variable, function, class) that only an earlier deep-dive
  section of the same notebook defines: a learner on the core path skips deep dives.

Pure logic on the notebook files (``ast``), no kernel: it runs in well under a second.
"""
from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import nbformat
import pytest

from labkit.quiz import all_banks

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(p for folder in ("solutions", "notebooks") for p in (ROOT / folder).glob("*.ipynb"))
IDS = [f"{p.parent.name}/{p.stem}" for p in LESSONS]
BANKS = all_banks(ROOT / "quizzes")
TAG = re.compile(r"\[(core|deep dive) · (\d+) min\]\s*$")
CORE_MINUTES = (65, 80)          # the seed lesson is 75 minutes (README: "How long it takes")


def code_of(source: str) -> str:
    """A code cell's source as Python: IPython magics and shell escapes blanked out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def quiz_calls(source: str) -> list[tuple[str, str]]:
    """``(verb, question id)`` for every ``lk.quiz.<verb>("id", ...)`` in a code cell."""
    out = []
    for node in ast.walk(ast.parse(code_of(source))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "quiz"):
            verb = node.func.attr
            ids = node.args if verb == "show" else node.args[:1]
            out += [(verb, a.value) for a in ids
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def code_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def undisplayed(path: Path) -> list[str]:
    """Question ids checked in a code cell without being displayed there or in the cell before."""
    cells = [quiz_calls(src) for src in code_cells(path)]
    missing = []
    for i, calls in enumerate(cells):
        shown = {qid for verb, qid in calls + (cells[i - 1] if i else [])
                 if verb in ("ask", "show")}
        missing += [f"{qid} (code cell {i + 1})" for verb, qid in calls
                    if verb == "check" and qid not in shown]
    return missing


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_checked_question_is_displayed_where_it_is_answered(path):
    missing = undisplayed(path)
    assert not missing, (
        f"{path.relative_to(ROOT)} checks questions the learner never sees: {missing}. Put "
        f'lk.quiz.ask("<id>") or lk.quiz.show("<id>", ...) in the same cell or the cell above')


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_bank_question_is_checked_in_its_notebook(path):
    bank = BANKS[path.stem]
    checked = {qid for src in code_cells(path) for verb, qid in quiz_calls(src) if verb == "check"}
    checked |= set(re.findall(r'lk\.exercise\.check\("([^"]+)"', "\n".join(code_cells(path))))
    never = [qid for qid in bank.questions if qid not in checked]
    assert not never, f"{path.relative_to(ROOT)} never checks {never} from {bank.path.name}"


def test_the_rule_catches_a_hidden_question(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('lk.quiz.show("00.sum_of_ranks")'),
        nbformat.v4.new_markdown_cell("text in between does not matter"),
        nbformat.v4.new_code_cell('q_sum_of_ranks = 10\nlk.quiz.check("00.sum_of_ranks", q_sum_of_ranks)\n'
                                  'lk.quiz.check("00.cpu_backend", "gloo")'),
        nbformat.v4.new_code_cell('%time x = 1\nlk.quiz.check("00.sum_of_ranks", 10)')])
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    assert undisplayed(path) == ["00.cpu_backend (code cell 2)", "00.sum_of_ranks (code cell 3)"]
