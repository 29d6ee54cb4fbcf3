"""The pytest plugin grades every lesson notebook in nbval's own kernel: it must be able to fail."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

pytestmark = pytest.mark.timeout(180)

WIDGET = "application/vnd.jupyter.widget-view+json"
ALL_RIGHT = {"q_what_is_a_rank": '"b"', "q_all_reduce_twice": "18", "q_cpu_backend": '"gloo"',
             "q_job_result": '"ac"'}


def _notebook(folder, answers: dict) -> None:
    folder.mkdir()
    src = "\n".join(f"{k} = {v}" for k, v in answers.items())
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, folder / "00_setup.ipynb")


def _pytest(path) -> subprocess.CompletedProcess:
    return _pytest_args(path)


def _pytest_args(path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval-lax", "--nbval-current-env", "-p", "labkit.grading.pytest_plugin",
                           "--rootdir", str(path), *args, str(path)],
                          capture_output=True, text=True, timeout=150, cwd=path,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                               **(env or {})})


def test_a_solved_notebook_short_of_full_marks_fails_its_grade_item(tmp_path):
    _notebook(tmp_path / "solutions", {**ALL_RIGHT, "q_all_reduce_twice": "6"})
    out = _pytest(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "00_setup.ipynb::grade" in out.stdout and "must score full marks" in out.stdout
    assert "00.all_reduce_twice" in out.stdout and "00.cpu_backend" not in out.stdout


def test_a_full_marks_solution_passes_and_an_answered_student_notebook_fails(tmp_path):
    _notebook(tmp_path / "solutions", ALL_RIGHT)
    _notebook(tmp_path / "notebooks", {"q_cpu_backend": '"gloo"', "q_all_reduce_twice": "None"})
    out = _pytest(tmp_path)
    assert "1 failed, 3 passed" in out.stdout, out.stdout
    assert "notebooks/00_setup.ipynb::grade" in out.stdout and "must score zero" in out.stdout


BANK = '''[[question]]
id = "91.answer"
kind = "exercise"
prompt = "Write answer(): return 3."
variable = "answer"
checker = "logged_checks.py:check_answer"
'''
CHECKER = '''import os
from labkit.grading.exercise import Case


def check_answer(fn):
    """Logs every run (kernel or grade item) to $LABKIT_TEST_CHECK_LOG: what fn returned."""
    got = fn()
    with open(os.environ["LABKIT_TEST_CHECK_LOG"], "a") as log:
        log.write(f"{got}\\n")
    return [Case("returns 3", got == 3, f"returned {got}")]
'''


def test_the_grade_item_reuses_a_check_only_for_the_very_function_it_checked(tmp_path):
    """A check cell's Score stands in for the grade only while the variable holds the function
    it checked: a function redefined after its check is checked again, and fails."""
    quizzes, log = tmp_path / "quizzes", tmp_path / "checks.log"
    quizzes.mkdir()
    (quizzes / "91_reuse.toml").write_text(BANK)
    (quizzes / "logged_checks.py").write_text(CHECKER)
    check = ('import labkit as lk\ndef answer():\n    return 3\n'
             'lk.exercise.check("91.answer", answer)')
    (tmp_path / "solutions").mkdir()
    for name, cells in (("91_reuse", [check]),
                        ("91_redefined", [check, "def answer():\n    return 4"])):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nb.metadata["labkit"] = {"bank": "91_reuse"}
        nbformat.write(nb, tmp_path / "solutions" / f"{name}.ipynb")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--nbval-lax", "--nbval-current-env",
                          "-p", "labkit.grading.pytest_plugin",
                          "--rootdir", str(tmp_path), str(tmp_path / "solutions")],
                         capture_output=True, text=True, timeout=150, cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                              "LABKIT_QUIZ_DIR": str(quizzes), "LABKIT_TEST_CHECK_LOG": str(log)})
    assert "1 failed, 4 passed" in out.stdout, out.stdout + out.stderr
    assert "91_redefined.ipynb::grade" in out.stdout and "returned 4" in out.stdout
    # two check cells (3, 3), one re-check of the redefined function (4): the kept one not re-run
    assert sorted(log.read_text().split()) == ["3", "3", "4"]


def test_a_solved_notebook_leaves_an_executed_copy_with_its_outputs_and_a_header(tmp_path):
    """The copy, written by the xdist worker that ran the notebook, holds this run's outputs (a
    stream, a result, a PNG figure, a cell's error; a widget's view, whose state no page could
    show, dropped), headed by when, where and with what it ran and which cell failed; a student
    notebook and a notebook only partly run (``-k``) leave none."""
    quizzes = tmp_path / "quizzes"
    quizzes.mkdir()
    (quizzes / "92_executed.toml").write_text(
        '[[question]]\nid = "92.x"\nkind = "numeric"\nprompt = "x?"\nvariable = "q_x"\n'
        'answer = 1\n')
    cells = ["q_x = 1",
             'print("hello from the run")\n6 * 7',
             "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
             "from IPython.display import display\n"
             f"display({{{WIDGET!r}: {{'model_id': 'm', 'version_major': 2}}, "
             "'text/plain': 'VBox()'}, raw=True)",
             "1 / 0"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A heading"),
                                         *map(nbformat.v4.new_code_cell, cells)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    for folder, notebook in (("solutions", nb),
                             ("notebooks", nbformat.v4.new_notebook(
                                 cells=[nbformat.v4.new_code_cell("q_x = None")],
                                 metadata=nb.metadata))):
        (tmp_path / folder).mkdir()
        nbformat.write(notebook, tmp_path / folder / "92_executed.ipynb")
    out = _pytest_args(tmp_path, "-n", "2", "--dist", "loadfile",   # as the lab's test command
                       env={"LABKIT_QUIZ_DIR": str(quizzes)})
    assert "1 failed, 7 passed" in out.stdout, out.stdout + out.stderr   # 1 / 0
    executed = tmp_path / "build" / "executed"
    assert sorted(p.name for p in executed.iterdir()) == ["92_executed.ipynb"]   # not notebooks/
    copy = nbformat.read(executed / "92_executed.ipynb", as_version=4)
    nbformat.validate(copy)
    header, *cells = copy.cells
    assert [c.source for c in cells] == [c.source for c in nb.cells]
    for words in ("Executed copy", "solutions/92_executed.ipynb", "**When:**", "**Where:**",
                  "CPU:", "GPU:", "Python ", "torch ", "**Failed:** In [5]", "**Widgets:** 1"):
        assert words in header.source, (words, header.source)
    assert header.metadata["labkit"]["executed"]["torch"]
    code = [c for c in cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3, 4, 5]
    assert code[1].outputs[0].text == "hello from the run\n"
    seconds = [c.metadata.get("labkit", {}).get("seconds") for c in code]
    assert all(isinstance(t, float) and 0 <= t < 60 for t in seconds), seconds   # each cell's
    assert code[1].outputs[1].data["text/plain"] == "42"
    assert any("image/png" in o.get("data", {}) for o in code[2].outputs)
    assert [o.data for o in code[3].outputs] == [{"text/plain": "[an interactive widget: it "
                                                  "works only in a live notebook, and nothing of "
                                                  "it is saved here]"}]
    assert code[4].outputs[-1].ename == "ZeroDivisionError"

    (executed / "92_executed.ipynb").unlink()
    out = _pytest_args(tmp_path, "-k", "not 4", env={"LABKIT_QUIZ_DIR": str(quizzes)})
    assert "7 passed, 1 deselected in" in out.stdout, out.stdout   # Cell 4 deselected
    assert not executed.joinpath("92_executed.ipynb").exists()
