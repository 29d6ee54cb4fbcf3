"""Notebook 06 follows the lab's notebook rules (CONVENTIONS.md "Notebooks"), checked statically.

Route tags on every ``##`` heading, Evaluation last with every graded item and the total, every
checked question displayed in its cell or the one above, every bank question checked, no core
section using a name only a deep dive defines. Pure logic on the two notebook files: no kernel.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from labkit.grading.bank import load_bank

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [ROOT / "solutions" / "06_sharding.ipynb", ROOT / "notebooks" / "06_sharding.ipynb"]
BANK = load_bank(ROOT / "quizzes" / "06_sharding.toml")
TAG = re.compile(r"\[(core|deep dive) · (\d+) min\]\s*$")


def cells(path):
    return nbformat.read(path, as_version=4).cells


def quiz_calls(source: str) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Attribute) and node.func.value.attr in (
                    "quiz", "exercise"):
            args = node.args if node.func.attr == "show" else node.args[:1]
            out += [(node.func.attr, a.value) for a in args if isinstance(a, ast.Constant)]
    return out


def sections(path) -> list[tuple[str, str, list]]:
    """(heading, route, cells) per ``##`` section, in order."""
    out = []
    for c in cells(path):
        for line in c.source.splitlines() if c.cell_type == "markdown" else []:
            if line.startswith("## "):
                m = TAG.search(line)
                out.append((line, m.group(1) if m else "", []))
        if out:
            out[-1][2].append(c)
    return out


@pytest.mark.parametrize("path", VERSIONS, ids=["solutions", "notebooks"])
def test_every_section_has_a_route_tag_and_evaluation_is_last(path):
    secs = sections(path)
    untagged = [h for h, route, _ in secs if not route]
    assert not untagged, f"## headings without [core · N min] / [deep dive · N min]: {untagged}"
    assert secs[-1][0].startswith("## Evaluation [core · "), secs[-1][0]
    evaluation = "\n".join(c.source for c in secs[-1][2])
    for qid, q in BANK.questions.items():
        row = next((ln for ln in evaluation.splitlines() if ln.startswith(f"| {qid}")), None)
        assert row and f"| {q.points:g} |" in row, f"Evaluation has no row for {qid} ({q.points:g})"
    assert f"**{BANK.max_points:g}**" in evaluation


@pytest.mark.parametrize("path", VERSIONS, ids=["solutions", "notebooks"])
def test_every_checked_question_is_displayed_where_it_is_answered_and_all_are_checked(path):
    code = [quiz_calls(c.source) for c in cells(path) if c.cell_type == "code"]
    checked = set()
    for i, calls in enumerate(code):
        shown = {q for verb, q in calls + (code[i - 1] if i else []) if verb in ("show", "ask")}
        for verb, qid in calls:
            if verb == "check":
                checked.add(qid)
                assert qid in shown or BANK.questions[qid].kind == "exercise", \
                    f"{qid} is checked in code cell {i + 1} but not shown there or just above"
    assert checked == set(BANK.questions), set(BANK.questions) ^ checked


def _names(source: str, kind) -> set[str]:
    tree = ast.parse(source)
    if kind == "defined":
        return {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)} | {n.name for n in ast.walk(tree)
                                               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def test_no_core_section_needs_a_name_only_a_deep_dive_defines():
    defined_in = {}
    for heading, route, section in sections(VERSIONS[0]):
        for c in section:
            if c.cell_type != "code":
                continue
            used = _names(c.source, "used")
            deep = {n for n in used if defined_in.get(n) == "deep dive"}
            assert route == "deep dive" or not deep, f"{heading} uses {deep} from a deep dive"
            for n in _names(c.source, "defined"):
                defined_in.setdefault(n, route)


def test_the_core_path_fits_a_lesson_and_the_minutes_add_up():
    minutes = {"core": 0, "deep dive": 0}
    for heading, route, _ in sections(VERSIONS[0]):
        minutes[route] += int(TAG.search(heading).group(2))
    assert 90 <= minutes["core"] <= 150 and minutes["deep dive"] <= 20, minutes
