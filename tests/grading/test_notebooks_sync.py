"""Student notebooks are generated from solutions/ and must not drift (labkit.grading.students)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.students import BEGIN, NotebookSourceError, generate, stub_code, stub_markdown

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


# ------------------------------------------------------------- the stub rules
def test_function_region_becomes_not_implemented_at_its_indentation():
    src = ("def ring(t, world_size):\n    n = t.numel()\n    for step in range(2):\n"
           f"        {BEGIN}\n        t += 1\n        ### END SOLUTION\n    return t")
    assert stub_code(src) == (
        "def ring(t, world_size):\n    n = t.numel()\n    for step in range(2):\n"
        '        raise NotImplementedError("ring: write your code here")\n    return t')


def test_top_level_region_becomes_none_assignments():
    src = (f"{BEGIN}\nq_a = 6\nq_b: list = [1,\n  2]\n### END SOLUTION\n"
           'lk.quiz.check("03.a", q_a)')
    assert stub_code(src) == ("q_a = None  # YOUR ANSWER HERE\nq_b = None  # YOUR ANSWER HERE\n"
                              'lk.quiz.check("03.a", q_a)')


def test_code_without_regions_is_unchanged_and_markdown_regions_are_replaced():
    src = "x = 1\n%time y = 2"
    assert stub_code(src) == src
    assert stub_markdown(f"Why?\n{BEGIN}\nBecause.\n### END SOLUTION") == "Why?\nYOUR ANSWER HERE"


@pytest.mark.parametrize("src, message", [
    (f"{BEGIN}\nprint(3)\n### END SOLUTION", "may hold only simple assignments"),
    (f"{BEGIN}\na, b = 1, 2\n### END SOLUTION", "may hold only simple assignments"),
    (f"{BEGIN}\nq = (\n### END SOLUTION", "does not parse"),
    (f"if x:\n    {BEGIN}\n    y = 1\n    ### END SOLUTION", "must be inside a function body"),
    (f"{BEGIN}\nq = 1", "is never closed"),
    ("### END SOLUTION", "without ### BEGIN SOLUTION"),
    (f"{BEGIN}\n{BEGIN}\n### END SOLUTION", "inside another region"),
])
def test_malformed_regions_name_cell_and_line(src, message):
    with pytest.raises(NotebookSourceError) as err:
        stub_code(src, "solutions/x.ipynb, cell 4")
    assert message in str(err.value) and "solutions/x.ipynb, cell 4" in str(err.value)


# ------------------------------------------------------------ whole notebooks
def test_fixture_student_notebook_is_in_sync_and_clean():
    assert generate(FIXTURES / "solutions", FIXTURES / "notebooks", check=True) == []
    nb = nbformat.read(FIXTURES / "notebooks" / "90_fixture.ipynb", as_version=4)
    assert nb.metadata["labkit"]["bank"] == "90_fixture"
    text = "\n".join(c.source for c in nb.cells)
    assert "### BEGIN SOLUTION" not in text and "dist.all_reduce(t)" not in text
    assert 'raise NotImplementedError("sum_ranks: write your code here")' in text


def test_generate_strips_outputs_and_widget_state_and_check_reports_drift(tmp_path):
    sol, out = tmp_path / "solutions", tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "solutions", sol)
    nb = nbformat.read(sol / "90_fixture.ipynb", as_version=4)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="hello")]
    nb.cells[1].execution_count = 3
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026"}
    nb.cells[1].metadata["tags"] = ["keep-me"]
    nbformat.write(nb, sol / "90_fixture.ipynb")
    assert generate(sol, out, check=True) == ["90_fixture"]          # missing counts as drift
    assert not out.exists()                                          # --check writes nothing
    assert generate(sol, out) == ["90_fixture"] and generate(sol, out, check=True) == []
    student = nbformat.read(out / "90_fixture.ipynb", as_version=4)
    assert "widgets" not in student.metadata
    assert student.cells[1].outputs == [] and student.cells[1].execution_count is None
    assert student.cells[1].metadata == {"tags": ["keep-me"]}
    (out / "90_fixture.ipynb").write_text((out / "90_fixture.ipynb").read_text().replace(
        "YOUR ANSWER HERE", "my answer", 1))
    (out / "99_orphan.ipynb").write_text("{}")
    assert generate(sol, out, check=True) == ["90_fixture", "99_orphan"]


def test_cli_check_exits_nonzero_listing_drifted_notebooks(tmp_path):
    sol, out = tmp_path / "solutions", tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "solutions", sol)
    cmd = [sys.executable, "-m", "labkit", "students", "--solutions", str(sol),
           "--notebooks", str(out)]
    drift = subprocess.run(cmd + ["--check"], capture_output=True, text=True)
    assert drift.returncode == 1 and "90_fixture.ipynb differs" in drift.stdout
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    ok = subprocess.run(cmd + ["--check"], capture_output=True, text=True)
    assert ok.returncode == 0 and "up to date" in ok.stdout


@pytest.mark.skipif(not SOLUTIONS, reason="no solutions/*.ipynb yet")
@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_student_notebook_matches_its_solution(solution):
    drifted = generate(ROOT / "solutions", ROOT / "notebooks", [solution.stem], check=True)
    assert drifted == [], (f"notebooks/{solution.name} differs from solutions/{solution.name}: run "
                           f"`python -m labkit students` and commit the result")


def test_no_student_notebook_without_a_solution():
    orphans = [p.name for p in (ROOT / "notebooks").glob("*.ipynb")
               if not (ROOT / "solutions" / p.name).exists()]
    assert orphans == [], f"notebooks without a solutions/ source: {orphans}"
