"""The Gradescope autograder, for real: the zip built by the command, unpacked into a folder
laid out as Gradescope lays out ``/autograder``, ``setup.sh``'s install step run against this
environment, and ``run_autograder`` run on submissions of a quiz-only lesson (00: solved,
untouched, partly answered after hostile cells, garbage, truncated, none and several) and of
a lesson with a multi-process exercise (01: solved and untouched; the rest grades the same way).
Every ``results.json`` is checked against Gradescope's schema, the scores exactly, the key never
shown, and no process left behind.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import nbformat
import pytest
from conftest import marked_with

from labkit.grading import gradescope
from labkit.grading.bank import all_banks, bank_dir, load_bank

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ("00_setup", "01_data_vs_model_parallelism")
QUIZ_ONLY = LESSONS[0]   # partial, hostile and ungradable submissions: graded for this lesson only
CELL_TIMEOUT = 10   # the hostile submission's endless loop waits this long

# https://gradescope-autograders.readthedocs.io/en/latest/specs/ (the fields we may write)
TOP_FIELDS = {"score", "execution_time", "output", "output_format", "visibility",
              "stdout_visibility", "extra_data", "tests"}
TEST_FIELDS = {"score", "max_score", "status", "name", "number", "output", "output_format",
               "tags", "visibility", "extra_data"}
FORMATS = {"text", "html", "simple_format", "md", "ansi"}


def validate(results: dict) -> None:
    """Gradescope's results.json schema, and our own rule: the score is the tests' sum."""
    assert set(results) <= TOP_FIELDS, set(results) - TOP_FIELDS
    assert isinstance(results["score"], (int, float)) and results["score"] >= 0
    assert isinstance(results["execution_time"], int) and results["execution_time"] >= 0
    assert isinstance(results["output"], str) and results["output"].strip()
    assert results.get("output_format", "text") in FORMATS
    assert results.get("stdout_visibility") == "hidden"
    assert isinstance(results["tests"], list)
    for t in results["tests"]:
        assert set(t) <= TEST_FIELDS, set(t) - TEST_FIELDS
        assert isinstance(t["name"], str) and t["name"]
        assert isinstance(t["output"], str) and t["output"].strip()
        assert 0 <= t["score"] <= t["max_score"] + 1e-9
        assert t["status"] in ("passed", "failed")
        assert t["visibility"] in gradescope.VISIBILITIES
        assert t.get("output_format", "text") in FORMATS
    if results["tests"]:
        assert results["score"] == pytest.approx(sum(t["score"] for t in results["tests"]))


class Autograder:
    """One lesson's zip, unpacked and set up in a folder laid out as /autograder."""

    def __init__(self, lesson: str, tmp: Path):
        self.lesson, self.root = lesson, tmp / "autograder"
        self.bank = load_bank(bank_dir() / f"{lesson}.toml")
        zpath = tmp / f"{lesson}.zip"
        out = subprocess.run([sys.executable, "-m", "labkit", "gradescope", lesson[:2], "--out",
                              str(zpath), "--cell-timeout", str(CELL_TIMEOUT)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"wrote {zpath}" in out.stdout
        source = self.root / "source"
        with zipfile.ZipFile(zpath) as zf:
            self.names = set(zf.namelist())
            for info in zf.infolist():   # as Gradescope unpacks it: the modes the zip carries
                zf.extract(info, source)
                os.chmod(source / info.filename, (info.external_attr >> 16) & 0o777)
        # Gradescope copies run_autograder to /autograder and runs it from there
        shutil.copy2(source / "run_autograder", self.root / "run_autograder")
        setup = subprocess.run(["bash", str(source / "setup.sh")], capture_output=True,
                               text=True, timeout=600,
                               env={**os.environ, "LABKIT_PYTHON": sys.executable})
        self.setup_log = setup.stdout + setup.stderr
        assert setup.returncode == 0, self.setup_log

    def grade(self, files: dict[str, bytes], limit: float = 900) -> tuple[dict, str]:
        """Put ``files`` in submission/, run run_autograder; (results.json, its stdout).
        ``limit``: when the run is killed, as Gradescope kills one at its timeout."""
        for d in ("submission", "results"):
            shutil.rmtree(self.root / d, ignore_errors=True)
            (self.root / d).mkdir(parents=True)
        for name, data in files.items():
            (self.root / "submission" / name).parent.mkdir(parents=True, exist_ok=True)
            (self.root / "submission" / name).write_bytes(data)
        mark = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([str(self.root / "run_autograder")], cwd=self.root,
                              capture_output=True, text=True, timeout=limit,
                              env={**env, gradescope.ROOT_ENV: str(self.root),
                                   "LABKIT_TEST_MARK": mark})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        left = marked_with("LABKIT_TEST_MARK", mark)
        assert left == [], f"the autograder left processes behind: {left}"
        results = json.loads((self.root / "results" / "results.json").read_text())
        validate(results)
        return results, proc.stdout + proc.stderr


def solved(lesson: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / f"{lesson}.ipynb", as_version=4)


def partial_changes(bank) -> tuple[dict, float]:
    """A wrong answer to the first numeric question with a fixed key, none to the first single
    choice question: the cell that makes them, and the points they lose."""
    numeric = next(q for q in bank.questions.values() if q.kind == "numeric" and q.key is None)
    single = next(q for q in bank.questions.values() if q.kind == "single")
    wrong = float(numeric.answer) * 3 + 7
    return ({numeric.id: wrong, single.id: None},
            numeric.points + single.points)


HOSTILE = r'''
import json, os, pathlib, subprocess, sys
results = pathlib.Path(os.environ.get("LABKIT_AUTOGRADER_ROOT", "/autograder")) / "results" / "results.json"
fake = json.dumps({"score": 999, "output": "forged", "tests": []})
results.write_text(fake)       # a grade of its own, written where Gradescope reads it
results.with_name("hostile-ran").write_text("yes")
writer = ("import pathlib, time\nwhile True:\n    pathlib.Path(%r).write_text(%r)\n    time.sleep(0.05)"
          % (str(results), fake))
subprocess.Popen([sys.executable, "-c", writer], start_new_session=True,   # and again, later
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(fake)
'''


@pytest.fixture(scope="module")
def autograders(tmp_path_factory):
    """One unpacked, set-up autograder per lesson for the whole module (building one is a zip,
    an unpack and ``setup.sh``: half a minute here); a test that changes it restores it."""
    made: dict[str, Autograder] = {}

    def get(lesson: str) -> Autograder:
        if lesson not in made:
            made[lesson] = Autograder(lesson, tmp_path_factory.mktemp(lesson))
        return made[lesson]
    return get


@pytest.fixture(scope="module", params=LESSONS)
def graded(request, autograders):
    lesson = request.param
    ag = autograders(lesson)
    runs = {}
    runs["solved"] = ag.grade({f"{lesson}.ipynb": nbformat.writes(solved(lesson)).encode()})
    student = (ROOT / "notebooks" / f"{lesson}.ipynb").read_bytes()
    runs["student"] = ag.grade({f"{lesson}.ipynb": student})

    changes, lost = partial_changes(ag.bank)
    if lesson != QUIZ_ONLY:           # what follows grades the quiz: one lesson is enough
        return ag, runs, changes, lost
    # One grading for two tests (a whole notebook's run each): the solved notebook, partly
    # answered (its last cell changes two answers), after a cell that forges a grade and an
    # endless loop (it sleeps: the busy loop's interrupt is tests/grading/test_grade.py's)
    nb = solved(lesson)
    nb.cells[1:1] = [nbformat.v4.new_code_cell(HOSTILE),
                     nbformat.v4.new_code_cell("while True:\n    __import__('time').sleep(0.05)")]
    nb.cells.append(nbformat.v4.new_code_cell("\n".join(
        f"{ag.bank.questions[qid].variable} = {value!r}" for qid, value in changes.items())))
    runs["hostile"] = ag.grade({"my work/attempt.ipynb": nbformat.writes(nb).encode()})
    runs["hostile_ran"] = (ag.root / "results" / "hostile-ran").exists()
    time.sleep(0.5)
    runs["hostile_after"] = json.loads((ag.root / "results" / "results.json").read_text())

    runs["garbage"] = ag.grade({f"{lesson}.ipynb": bytes(range(256)) * 4})
    runs["truncated"] = ag.grade({f"{lesson}.ipynb": student[:len(student) // 2]})
    runs["none"] = ag.grade({"answers.py": b"q = 1\n", "notes.txt": b"hi"})
    runs["several"] = ag.grade({"a.ipynb": student, f"{lesson}.ipynb": student,
                                ".ipynb_checkpoints/x-checkpoint.ipynb": student})
    return ag, runs, changes, lost


def test_the_zip_has_gradescope_layout_and_the_lab(graded):
    ag, *_ = graded
    assert {"setup.sh", "run_autograder", "autograder.json", "requirements.txt",
            "pyproject.toml", f"quizzes/{ag.lesson}.toml", "labkit/__init__.py",
            "labkit/grading/grader.py"} <= ag.names
    assert not [n for n in ag.names if "__pycache__" in n or n.startswith("quizzes/")
                and n != f"quizzes/{ag.lesson}.toml"]
    for name in ("setup.sh", "run_autograder"):
        assert os.stat(ag.root / "source" / name).st_mode & stat.S_IXUSR
    reqs = (ag.root / "source" / "requirements.txt").read_text()
    assert "torch==2.13.0" in reqs and "-e" not in reqs and "playwright" not in reqs
    assert "ready to grade" in ag.setup_log and "Successfully installed" not in ag.setup_log
    assert (ag.root / "source" / ".python").read_text().strip() == sys.executable
    config = json.loads((ag.root / "source" / "autograder.json").read_text())
    assert config["bank"] == ag.lesson and config["limits"]["cell_timeout"] == CELL_TIMEOUT


def test_solved_scores_full_marks_with_one_test_per_item(graded):
    ag, runs, *_ = graded
    results, stdout = runs["solved"]
    assert results["score"] == pytest.approx(ag.bank.max_points)
    assert all(t["status"] == "passed" for t in results["tests"])
    names = [t["name"] for t in results["tests"]]
    for q in ag.bank.questions.values():
        if q.kind == "exercise":
            assert sum(n.startswith(f"{q.id} · ") for n in names) >= 2, names   # its cases
        else:
            assert q.id in names
    assert f"labkit from {ag.root / 'source'}" in stdout   # the zip's lab, not this checkout's


def test_untouched_student_notebook_scores_zero_for_the_right_reason(graded):
    ag, runs, *_ = graded
    results, _ = runs["student"]
    assert results["score"] == 0
    assert {t["name"] for t in results["tests"]} >= {q.id for q in ag.bank.questions.values()}
    for t in results["tests"]:
        assert t["status"] == "failed" and ("not answered" in t["output"]
                                            or "not done" in t["output"]), t


@pytest.mark.parametrize("graded", [QUIZ_ONLY], indirect=True)
def test_partly_answered_scores_exactly_and_never_shows_the_key(graded):
    ag, runs, changes, lost = graded
    results, _ = runs["hostile"]                # partly answered, after the hostile cells
    assert results["score"] == pytest.approx(ag.bank.max_points - lost)
    tests = {t["name"]: t for t in results["tests"]}
    for qid, value in changes.items():
        q, t = ag.bank.questions[qid], tests[qid]
        assert t["score"] == 0 and t["status"] == "failed"
        assert q.explanation not in t["output"]
        if value is None:
            assert "not answered" in t["output"]
        else:
            assert f"you answered {value:g}" in t["output"] and q.hint in t["output"]
            assert not re.search(rf"(?<![\d.]){re.escape(f'{float(q.answer):g}')}(?![\d])",
                                 t["output"]), t["output"]


@pytest.mark.parametrize("graded", [QUIZ_ONLY], indirect=True)
def test_hostile_submission_cannot_write_its_own_grade_and_leaves_nothing(graded):
    ag, runs, _, lost = graded
    results, _ = runs["hostile"]
    assert runs["hostile_ran"]    # the forging cell did run, and wrote its results.json
    assert results["score"] == pytest.approx(ag.bank.max_points - lost)  # answers still graded
    assert "cell 3 (while True:): timeout" in results["output"], results["output"]  # named
    assert runs["hostile_after"] == results    # the forger was stopped before the results


@pytest.mark.parametrize("graded", [QUIZ_ONLY], indirect=True)
@pytest.mark.parametrize("kind, says", [
    ("garbage", "not a notebook: the file is binary"),
    ("truncated", "the notebook is truncated"),
    ("none", "no notebook (.ipynb file)"),
    ("several", "2 notebooks ("),
])
def test_ungradable_submission_scores_zero_and_says_why(graded, kind, says):
    ag, runs, *_ = graded
    results, _ = runs[kind]
    assert results["score"] == 0 and results["tests"] == []
    assert says in results["output"] and f"0 / {ag.bank.max_points:g}" in results["output"]


# ------------------------------------------------------------------ failures of the grader
@pytest.fixture(scope="module")
def quiz_autograder(autograders):
    return autograders(QUIZ_ONLY)


def edit_config(ag: Autograder, **changes) -> dict:
    path = ag.root / "source" / "autograder.json"
    old = json.loads(path.read_text())
    path.write_text(json.dumps({**old, **changes}))
    return old


def test_watchdog_ends_grading_before_gradescope_does(quiz_autograder):
    ag = quiz_autograder
    timeout = gradescope.HARNESS_MARGIN_S + 15    # 15 s to grade: the kernel starts, then sleeps
    old = edit_config(ag, timeout_s=timeout)
    try:
        nb = solved("00_setup")
        nb.cells.insert(1, nbformat.v4.new_code_cell(
            "import os, pathlib, time\n"
            "pathlib.Path(os.environ['LABKIT_AUTOGRADER_ROOT'], 'results', 'asleep').touch()\n"
            "time.sleep(600)"))
        # killed, as Gradescope would kill it, unless the watchdog ended it with half its margin
        # left (subprocess.TimeoutExpired fails the test)
        results, _ = ag.grade({"00_setup.ipynb": nbformat.writes(nb).encode()},
                              limit=timeout - gradescope.HARNESS_MARGIN_S / 2)
    finally:
        edit_config(ag, **old)
    assert (ag.root / "results" / "asleep").exists()    # the cell was running when it fired
    assert results["score"] == 0 and "ran past the assignment's time limit" in results["output"]


def test_a_crashing_grader_still_writes_results(quiz_autograder):
    ag = quiz_autograder
    grader = ag.root / "source" / "labkit" / "grading" / "grader.py"
    text = grader.read_text()
    grader.write_text(text + "\nraise SystemExit(7)\n")
    try:
        results, _ = ag.grade({"00_setup.ipynb": (ROOT / "solutions" / "00_setup.ipynb")
                               .read_bytes()})
    finally:
        grader.write_text(text)
    assert results["score"] == 0 and "exit code 7" in results["output"]
    assert "tell your instructor" in results["output"]


def test_a_broken_install_still_writes_results(quiz_autograder):
    ag = quiz_autograder
    python = ag.root / "source" / ".python"
    python.write_text("/nonexistent/python\n")
    try:
        results, _ = ag.grade({"00_setup.ipynb": b"{}"})
    finally:
        python.write_text(sys.executable + "\n")
    assert results["score"] == 0 and "could not start" in results["output"]


def test_a_broken_config_still_writes_results(quiz_autograder):
    ag = quiz_autograder
    old = edit_config(ag, bank="99_missing")
    try:
        results, stdout = ag.grade({"00_setup.ipynb": b"{}"})
    finally:
        edit_config(ag, **old)
    assert results["score"] == 0 and "autograder itself failed" in results["output"]
    assert "99_missing" in stdout   # the instructor sees why


# ------------------------------------------------------------------ pure parts
def test_limits_give_every_bank_a_usable_split_and_name_the_least_timeout():
    for bank in all_banks(bank_dir()).values():
        lim = gradescope.limits(bank, gradescope.GRADESCOPE_TIMEOUT_S)
        assert lim["notebook_timeout"] >= 120 and 0 < lim["cell_timeout"] <= 120, bank.name
        assert lim["check_timeout"] >= 40, bank.name
        with pytest.raises(ValueError, match="at least") as err:
            gradescope.limits(bank, 100)
        least = float(re.search(r"at least (\d+) s", str(err.value)).group(1))
        assert gradescope.limits(bank, least)["notebook_timeout"] >= 60     # that is enough
        with pytest.raises(ValueError):
            gradescope.limits(bank, least - 1)                               # and the least


def test_worst_case_counts_what_the_grader_really_allows(monkeypatch):
    """worst_case_s against the limits the grader's parts really set: the checker process's own
    limit (captured from the call that starts it) and the kernel's start-up allowance."""
    from labkit.grading import kernel, sandbox

    bank = load_bank(bank_dir() / "08_capstone.toml")
    lim = gradescope.limits(bank, 1200)
    seen = {}

    def fake_run(what, argv, timeout, **kw):
        seen["limit"] = timeout
        return 0, b"", b""

    monkeypatch.setattr(sandbox.procs, "run", fake_run)
    remote = [q for q in bank.questions.values() if q.runs_submission_code]
    sandbox.score_in_sandbox(bank, remote, {}, lim["check_timeout"], lim["key_timeout"])
    quiz_only = dataclasses.replace(bank, questions={q.id: q for q in bank.questions.values()
                                                     if not q.runs_submission_code})
    assert gradescope.worst_case_s(bank, lim) - gradescope.worst_case_s(quiz_only, lim) \
        == pytest.approx(seen["limit"])
    assert gradescope.worst_case_s(quiz_only, lim) >= lim["notebook_timeout"] + \
        kernel.KERNEL_START_S + lim["collect_timeout"] + 2 * lim["grace"]


def test_exercise_cases_split_the_points_exactly():
    base = load_bank(bank_dir() / "01_data_vs_model_parallelism.toml")
    q = base.questions["01.two_stage_step"]
    cases = [{"name": f"case {i}", "passed": i != 2, "detail": ""} for i in range(4)]

    def results(partial: bool, points: float, status: str) -> dict:
        bank = dataclasses.replace(base, questions={**base.questions,
                                                    q.id: dataclasses.replace(q, partial=partial)})
        grade = {"status": "graded", "points": points, "max_points": q.points, "cells": [],
                 "notes": [], "questions": [{"id": q.id, "kind": "exercise", "points": points,
                                             "max_points": q.points, "status": status,
                                             "feedback": "3 of 4 cases pass", "answer": "f",
                                             "explanation": "", "cases": cases}]}
        out = {**gradescope.results_from_grade(grade, bank), "execution_time": 0}
        validate(out)
        return out

    whole = results(False, 0.0, "wrong")     # all or nothing: 3 passing cases earn nothing
    assert [t["score"] for t in whole["tests"]] == [0, 0, 0, 0]
    assert [t["status"] for t in whole["tests"]].count("passed") == 3
    assert "only when every case passes" in whole["tests"][0]["output"]
    split = results(True, q.points * 3 / 4, "partial")
    assert [t["score"] for t in split["tests"]] == pytest.approx([q.points / 4] * 2 + [0]
                                                                 + [q.points / 4])
    assert "only when" not in split["tests"][0]["output"]
    assert q.explanation not in split["tests"][0]["output"]   # it may state the answer


def test_hidden_visibility_keeps_the_points_out_of_the_summary():
    bank = load_bank(bank_dir() / "00_setup.toml")
    grade = {"status": "graded", "points": 3.0, "max_points": bank.max_points, "cells": [],
             "notes": [], "questions": []}
    shown = gradescope.results_from_grade(grade, bank, "visible")
    hidden = gradescope.results_from_grade(grade, bank, "after_due_date")
    assert "3 / 4 points" in shown["output"] and "points" not in hidden["output"]
    assert hidden["visibility"] == "after_due_date"


def test_a_forged_checker_score_is_refused():
    from labkit.grading.exercise import Case
    from labkit.grading.sandbox import _impossible
    from labkit.grading.score import Score

    bank = load_bank(bank_dir() / "01_data_vs_model_parallelism.toml")
    q = bank.questions["01.two_stage_step"]      # partial credit: points follow the cases
    cases = [Case("a", True), Case("b", False)]
    assert _impossible(q, Score(q.id, q.points / 2, q.points, "partial", "", cases=cases)) is None
    assert "cases passing" in _impossible(q, Score(q.id, q.points, q.points, "correct", "",
                                                   cases=cases))
    assert "points" in _impossible(q, Score(q.id, 1e6, q.points, "correct", ""))
    assert "another question" in _impossible(q, Score(q.id, 1.0, 1e6, "correct", ""))
    assert "without cases" in _impossible(q, Score(q.id, q.points, q.points, "correct", ""))


def test_no_hint_gives_the_key_away():
    """A wrong answer shows the bank's hint: it must not state a fixed key."""
    for bank in all_banks(bank_dir()).values():
        for q in bank.questions.values():
            if not q.hint or q.answer is None:
                continue
            if q.kind == "numeric":
                key = f"{float(q.answer):g}"
                assert not re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", q.hint), q.id
            elif q.kind == "single":
                assert q.answer not in q.hint, q.id
            elif q.kind == "multi":
                assert not [a for a in q.answer if a in q.hint], q.id
            elif q.kind == "short":
                keys = [q.answer] if isinstance(q.answer, str) else q.answer
                assert not [k for k in keys if re.search(rf"\b{re.escape(k)}\b", q.hint, re.I)], q.id


def test_build_refuses_bad_arguments(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "labkit", "gradescope", *args],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = cli("42_nothing")
    assert out.returncode == 2 and "no lesson '42_nothing'" in out.stderr
    out = cli("08", "--timeout", "100")
    assert out.returncode == 2 and "give it at least" in out.stderr
    out = cli("08", "--timeout", "3000")
    assert out.returncode == 2 and "40 minutes" in out.stderr
    out = cli("00", "--cell-timeout", "0")
    assert out.returncode == 2 and "more than 0" in out.stderr
    assert list(tmp_path.iterdir()) == []
