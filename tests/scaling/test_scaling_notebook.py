"""Notebook 07 follows the lab's notebook rules (CONVENTIONS.md "Notebooks"), checked statically
on both versions: every checked question is displayed in its cell or the one above, every bank
question is checked, every ## heading has a route tag, no core section needs a name only a deep
dive defines, and the last section is the Evaluation rubric of every graded item."""
from __future__ import annotations

import ast
import builtins
import re
import symtable
from pathlib import Path

import nbformat
import pytest

from labkit.grading.bank import load_bank

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [ROOT / "solutions" / "07_scaling.ipynb", ROOT / "notebooks" / "07_scaling.ipynb"]
BANK = load_bank(ROOT / "quizzes" / "07_scaling.toml")
TAG = re.compile(r"\[(core|deep dive) · (\d+) min\]\s*$")


def _code(src: str) -> str:
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines())


def _quiz_calls(src: str) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(_code(src))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("quiz", "exercise")):
            args = node.args if node.func.attr == "show" else node.args[:1]
            out += [(f"{node.func.value.attr}.{node.func.attr}", a.value) for a in args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def _sections(path: Path) -> list[dict]:
    nb = nbformat.read(path, as_version=4)
    out = [{"title": "(preamble)", "route": "core", "tagged": True, "md": [], "code": []}]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    m = TAG.search(line)
                    out.append({"title": line[3:], "route": m and m.group(1), "tagged": bool(m),
                                "md": [], "code": []})
                out[-1]["md"].append(line)
        else:
            out[-1]["code"].append(cell.source)
    return out


@pytest.mark.parametrize("path", VERSIONS, ids=lambda p: p.parent.name)
def test_every_checked_question_is_displayed_and_every_bank_question_checked(path):
    cells = [_quiz_calls(s) for sec in _sections(path) for s in sec["code"]]
    hidden, checked = [], set()
    for i, calls in enumerate(cells):
        shown = {q for v, q in calls + (cells[i - 1] if i else []) if v in ("quiz.ask", "quiz.show")}
        for verb, qid in calls:
            if verb in ("quiz.check", "exercise.check"):
                checked.add(qid)
                if verb == "quiz.check" and qid not in shown:
                    hidden.append(qid)
    assert not hidden, f"checked but never displayed where answered: {hidden}"
    assert checked == set(BANK.questions), set(BANK.questions) ^ checked


@pytest.mark.parametrize("path", VERSIONS, ids=lambda p: p.parent.name)
def test_every_heading_is_tagged_and_no_core_section_needs_a_deep_dive(path):
    sections = _sections(path)
    assert all(s["tagged"] for s in sections), [s["title"] for s in sections if not s["tagged"]]
    core, deep, leaks = set(dir(builtins)), set(), []
    for s in sections:
        for src in s["code"]:
            top = symtable.symtable(_code(src), "<cell>", "exec")
            bound = {x.get_name() for x in top.get_symbols() if x.is_assigned() or x.is_imported()}
            used, todo = set(), [top]
            while todo:
                t = todo.pop()
                todo += t.get_children()
                used |= {x.get_name() for x in t.get_symbols()
                         if x.is_referenced() and (t is top or x.is_global())}
            if s["route"] == "core":
                leaks += sorted((used - bound - core) & deep)
                core |= bound
            else:
                deep |= bound
    assert not leaks, f"core sections use names only a deep dive defines: {leaks}"


@pytest.mark.parametrize("path", VERSIONS, ids=lambda p: p.parent.name)
def test_the_evaluation_rubric_lists_every_graded_item_with_its_points_and_route(path):
    sections = _sections(path)
    last = sections[-1]
    assert last["title"].startswith("Evaluation") and last["route"] == "core"
    text = "\n".join(last["md"])
    rows = {m.group(1): m for m in re.finditer(
        r"^\| [^|]+ \| `(\d\d\.\w+)`[^|]* \| ([\d.]+)[^|]* \| (core|deep dive) \|$", text, re.M)}
    assert sorted(rows) == sorted(BANK.questions)
    route_of = {}
    for s in sections:
        for src in s["code"]:
            for _, qid in _quiz_calls(src):
                route_of.setdefault(qid, s["route"])
    for qid, q in BANK.questions.items():
        assert float(rows[qid].group(2)) == q.points and rows[qid].group(3) == route_of[qid], qid
    core = sum(q.points for qid, q in BANK.questions.items() if route_of[qid] == "core")
    total = BANK.max_points
    assert f"**{total:g}**" in text and f"core: {core:g}" in text
    assert f"**{total:g} / {total:g}**" in text
