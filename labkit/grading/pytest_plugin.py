"""pytest plugin for the lab's notebooks (loaded by ``-p labkit.grading.pytest_plugin``).

Two things happen on top of nbval when ``pytest`` runs the notebooks:

1. **Every check in a solved notebook must pass.** ``LABKIT_EXPECT_SOLVED=1`` makes a quiz or
   exercise check that is not correct raise instead of print; the kernel inherits it when nbval
   starts it, so this plugin sets it for notebooks under ``solutions/`` and clears it elsewhere
   (student notebooks must run clean with nothing answered).
2. **Each notebook is graded in the same run** — one execution, two verdicts. After nbval's last
   cell, an extra item ``grade`` collects the bank's answer variables from nbval's live kernel
   exactly as ``python -m labkit grade`` does, and scores them here, in pytest's process, with the
   bank's key and checkers: a solved notebook must score full marks, an untouched student
   notebook zero. (The grader's own path — fresh kernel, time limits, hostile submissions — is
   tested on small notebooks in ``tests/grading/test_grade.py``.)
"""
from __future__ import annotations

import os
import tempfile
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
        from .bank import all_banks
        from .grader import Options, bank_for, lesson_grade_problems, score_collected
        from .kernel import collector_source, read_values

        nbfile, path = self.parent, Path(str(self.fspath))
        kernel = nbfile.kernel
        if kernel is None or not kernel.is_alive():
            pytest.fail("the notebook's kernel is gone: it cannot be graded")
        opts = Options()
        bank = bank_for(nbfile.nb, path, all_banks(opts.banks_path()))
        with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
            msg_id = kernel.execute_cell_input(collector_source(bank.names, tmp, bank.pickled))
            kernel.await_idle(msg_id, opts.collect_timeout)
            collected = read_values(Path(tmp), bank.names)
        scores = score_collected(bank, collected, opts)
        self.user_properties.append(("points", sum(s.points for s in scores)))
        problem = lesson_grade_problems(scores, solved=_lesson_folder(path) == "solutions")
        assert problem is None, problem

    def reportinfo(self):
        return self.fspath, 0, f"{self.parent.name}::grade"
