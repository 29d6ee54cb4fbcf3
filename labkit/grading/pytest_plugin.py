"""pytest plugin for the lab's notebooks (loaded by ``-p labkit.grading.pytest_plugin``).

Two things happen on top of nbval when ``pytest`` runs the notebooks:

1. **Every check in a solved notebook must pass.** ``LABKIT_EXPECT_SOLVED=1`` makes a quiz or
   exercise check that is not correct raise instead of print; the kernel inherits it when nbval
   starts it, so this plugin sets it for notebooks under ``solutions/`` and clears it elsewhere
   (student notebooks must run clean with nothing answered).
2. **Each notebook is graded in the same run** — one execution, two verdicts. After nbval's last
   cell, an extra item ``grade`` collects the bank's answer variables from nbval's live kernel
   exactly as ``python -m labkit grade`` does, and scores them with the bank's key and checkers
   here, in pytest's process (the lab's own notebooks are trusted, so no checker process is
   started for them; an exercise its check cell already scored on the same function keeps
   that Score: :func:`labkit.grading.grader.grade_lesson_kernel`): a solved notebook must
   score full marks, an untouched student notebook zero. (The grader's own path — fresh
   kernel, time limits, the checker process, hostile submissions — is tested on small
   notebooks in ``tests/grading/test_grade.py``.)
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

_FOLDERS = ("solutions", "notebooks")


def _lesson_folder(path: Path) -> str | None:
    return path.parent.name if path.suffix == ".ipynb" and path.parent.name in _FOLDERS else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _lesson_folder(Path(str(item.fspath))) == "solutions":
        os.environ["LABKIT_EXPECT_SOLVED"] = "1"
    else:
        os.environ.pop("LABKIT_EXPECT_SOLVED", None)


def pytest_collection_modifyitems(session, config, items):
    """Put a ``grade`` item right after the last cell of every lesson notebook."""
    out, last = [], {}
    for item in items:
        out.append(item)
        if _lesson_folder(Path(str(item.fspath))) and hasattr(item.parent, "kernel"):
            last[item.parent] = len(out)
    for parent, index in sorted(last.items(), key=lambda kv: -kv[1]):
        out.insert(index, GradeItem.from_parent(parent, name="grade"))
    items[:] = out


class GradeItem(pytest.Item):
    """Score the answers left in nbval's kernel with the grader's own key."""

    def runtest(self):
        from .grader import Options, grade_lesson_kernel

        nbfile, path = self.parent, Path(str(self.fspath))
        kernel = nbfile.kernel
        if kernel is None or not kernel.is_alive():
            pytest.fail("the notebook's kernel is gone: it cannot be graded")

        def run_cell(source):
            kernel.await_idle(kernel.execute_cell_input(source), Options().collect_timeout)

        scores, problem = grade_lesson_kernel(nbfile.nb, path, run_cell,
                                              solved=_lesson_folder(path) == "solutions")
        self.user_properties.append(("points", sum(s.points for s in scores)))
        assert problem is None, problem

    def reportinfo(self):
        return self.fspath, 0, f"{self.parent.name}::grade"
