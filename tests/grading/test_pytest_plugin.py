"""The pytest plugin grades every lesson notebook in nbval's own kernel: it must be able to fail."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

pytestmark = pytest.mark.timeout(180)

ALL_RIGHT = {"q_what_is_a_rank": '"b"', "q_sum_of_ranks": "10", "q_cpu_backend": '"gloo"',
             "q_job_result": '"ac"'}


def _notebook(folder, answers: dict) -> None:
    folder.mkdir()
    src = "\n".join(f"{k} = {v}" for k, v in answers.items())
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, folder / "00_setup.ipynb")


def _pytest(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval-lax", "--nbval-current-env", "-p", "labkit.grading.pytest_plugin",
                           "--rootdir", str(path), str(path)],
                          capture_output=True, text=True, timeout=150, cwd=path,
                          env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})


def test_a_solved_notebook_short_of_full_marks_fails_its_grade_item(tmp_path):
    _notebook(tmp_path / "solutions", {**ALL_RIGHT, "q_sum_of_ranks": "11"})
    out = _pytest(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "00_setup.ipynb::grade" in out.stdout and "must score full marks" in out.stdout
    assert "00.sum_of_ranks" in out.stdout and "00.cpu_backend" not in out.stdout


def test_a_full_marks_solution_passes_and_an_answered_student_notebook_fails(tmp_path):
    _notebook(tmp_path / "solutions", ALL_RIGHT)
    _notebook(tmp_path / "notebooks", {"q_cpu_backend": '"gloo"', "q_sum_of_ranks": "None"})
    out = _pytest(tmp_path)
    assert "1 failed, 3 passed" in out.stdout, out.stdout
    assert "notebooks/00_setup.ipynb::grade" in out.stdout and "must score zero" in out.stdout
