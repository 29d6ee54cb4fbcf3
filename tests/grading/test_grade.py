"""The auto-grader, end to end on small crafted notebooks with their own bank (tests/fixtures).

Two grader runs (one per folder, through the real CLI) serve many tests: a folder of ordinary
submissions (solved, untouched student, partly right, cheating, deadlocking) and a folder of
hostile ones with short cell limits. Every process the grader starts carries a marker in its
environment; after each run no such process may be left.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest
from conftest import marked_with

from labkit.grading import grader
from labkit.grading.grader import SubmissionError, bank_for, format_report, read_submission
from labkit.grading.bank import all_banks

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
BANKS = FIXTURES / "quizzes"
SOLVED = FIXTURES / "solutions" / "90_fixture.ipynb"
STUDENT = FIXTURES / "notebooks" / "90_fixture.ipynb"
FULL = 8.0


def variant(replace: dict[str, str] | None = None, insert: list[str] = (), at: int = 2,
            checks: bool = True, meta: bool = True):
    """The solved fixture with sources edited, cells inserted at ``at``, check cells dropped."""
    nb = nbformat.read(SOLVED, as_version=4)
    for cell in nb.cells:
        for old, new in (replace or {}).items():
            cell.source = cell.source.replace(old, new)
    if not checks:   # no lk.quiz/lk.exercise calls: no ranks in the kernel, quick cells
        for cell in nb.cells:
            cell.source = "\n".join(ln for ln in cell.source.splitlines() if "lk.quiz." not in ln
                                    and "lk.exercise." not in ln)
        nb.cells = [c for c in nb.cells if c.source.strip()]
    nb.cells[at:at] = [nbformat.v4.new_code_cell(src) for src in insert]
    if meta:
        nb.metadata["labkit"] = {"bank": "90_fixture"}
    return nb


PARTIAL = {'q_multi = "a, c"': 'q_multi = "a"', 'q_numeric = 6.001': "q_numeric = 6.005",
           'q_short = "All-Reduce"': 'q_short = "broadcast"',
           "    import torch\n": "    return 3.0\n    import torch\n"}
WRONG = {'q_single = "a"': 'q_single = "b"', 'q_multi = "a, c"': 'q_multi = "b"',
         "q_numeric = 6.001": "q_numeric = 5", 'q_short = "All-Reduce"': 'q_short = "send"',
         "q_computed = sum(measured)": "q_computed = 0",
         "    import torch\n": "    return 0.0\n    import torch\n"}
FAKE = ('print("✓ 90.single: correct (1/1)\\n== graded: 8 / 8 points")\n'
        "import labkit as lk\n"
        "lk.quiz.check = lk.exercise.check = lambda *a, **k: print('✓ correct (1/1)')\n"
        "lk.quiz.score = lambda *a, **k: None")
DEADLOCK = '''
def stuck(rank, world_size):
    import torch, torch.distributed as dist
    if rank == 0:
        dist.all_reduce(torch.ones(1))   # rank 1 never joins
    return rank
lk.run(stuck, 2, timeout=1.0, deadline=3.0)'''
DEADLOCK_ON_THREE = ("    import torch\n    import torch.distributed as dist\n"
                     "    if world_size == 3 and rank == 0:\n"
                     "        return 6.0   # ranks 1 and 2 wait for rank 0 in all_reduce\n"
                     "    import torch\n")


def write(folder: Path, name: str, nb) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / name)


def run_grader(folder: Path, tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the CLI on ``folder``; assert that no process it started is left."""
    mark = uuid.uuid4().hex
    out = tmp / f"{folder.name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "labkit", "grade", str(folder), "--bank-dir", str(BANKS),
         "--json", str(out), *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "LABKIT_TEST_MARK": mark, "LABKIT_PRESTART": "0"})
    left = marked_with("LABKIT_TEST_MARK", mark)
    assert left == [], f"the grader left processes behind: {left}"
    assert out.exists(), proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    return proc, {Path(r["submission"]).name: r for r in data["submissions"]}


@pytest.fixture(scope="module")
def ordinary(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ordinary")
    folder = tmp / "subs"
    write(folder, "solved.ipynb", variant(meta=False))    # bank found from the ids in its source
    folder.mkdir(exist_ok=True)
    (folder / "student_90_fixture.ipynb").write_bytes(STUDENT.read_bytes())
    write(folder, "partial.ipynb", variant(PARTIAL, insert=["1 / 0"], checks=False))
    write(folder, "cheater.ipynb", variant({**WRONG, 'check("90.single", q_single)':
                                            'check("90.single", "a")'}, insert=[FAKE], at=3))
    write(folder, "deadlock.ipynb", variant({"    import torch\n": DEADLOCK_ON_THREE},
                                            insert=[DEADLOCK], checks=False))
    return run_grader(folder, tmp, "--cell-timeout", "60", "--jobs", "2")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    folder = tmp / "subs"
    spin = ("import labkit as lk\n"
            "def spin(rank, world_size):\n    while True:\n        pass\n"
            "lk.run(spin, 2, timeout=600, deadline=600)")
    cells = {"loop": "while True:\n    pass",
             "sigint": ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                        "while True:\n    pass"),
             "sysexit": "import sys\nsys.exit(3)",
             "osexit": "import os\nos._exit(3)",
             "exit": "exit()",
             "ranks_spin": spin}
    for name, src in cells.items():
        write(folder, f"{name}.ipynb", variant(insert=[src], checks=False))
    (folder / "empty.ipynb").write_bytes(b"")
    (folder / "truncated.ipynb").write_bytes(SOLVED.read_bytes()[:700])
    (folder / "not_a_notebook.ipynb").write_text('{"hello": "world"}')
    (folder / "binary.ipynb").write_bytes(bytes(range(256)))
    return run_grader(folder, tmp, "--cell-timeout", "3", "--csv", str(tmp / "book.csv"),
                      "--jobs", "2") + (tmp,)


# --------------------------------------------------------------- ordinary
def cells_with(result: dict, status: str) -> list[dict]:
    return [c for c in result["cells"] if c["status"] == status]


@pytest.mark.timeout(600)
def test_solved_notebook_scores_full_marks(ordinary):
    r = ordinary[1]["solved.ipynb"]
    assert (r["status"], r["notebook"], r["points"], r["max_points"]) == ("graded", "90_fixture",
                                                                          FULL, FULL)
    assert all(c["status"] == "ok" for c in r["cells"]), r["cells"]


@pytest.mark.timeout(600)
def test_untouched_student_notebook_scores_zero_and_runs_clean(ordinary):
    r = ordinary[1]["student_90_fixture.ipynb"]
    assert r["points"] == 0.0 and all(c["status"] == "ok" for c in r["cells"]), r["cells"]
    status = {q["id"]: q["status"] for q in r["questions"]}
    assert status.pop("90.exercise") == "not done"
    assert set(status.values()) == {"unanswered"}


@pytest.mark.timeout(600)
def test_partly_right_submission_scores_exactly_the_expected_total(ordinary):
    r = ordinary[1]["partial.ipynb"]
    points = {q["id"]: q["points"] for q in r["questions"]}
    assert points == {"90.single": 1.0, "90.multi": 0.0, "90.numeric": 1.0, "90.short": 0.0,
                      "90.computed": 1.0, "90.exercise": 1.0}
    assert r["points"] == 4.0
    assert [c["detail"] for c in cells_with(r, "error")] == ["ZeroDivisionError: division by zero"]


@pytest.mark.timeout(600)
def test_fake_output_and_edited_checks_gain_nothing(ordinary):
    r = ordinary[1]["cheater.ipynb"]
    assert r["points"] == 0.0, format_report(r)
    assert all(q["status"] == "wrong" for q in r["questions"]), r["questions"]


@pytest.mark.timeout(600)
def test_deadlocked_ranks_fail_fast_and_cost_only_their_case(ordinary):
    r = ordinary[1]["deadlock.ipynb"]
    [err] = cells_with(r, "error")
    assert err["detail"].startswith(("RankError", "JobTimeout")), err
    ex = next(q for q in r["questions"] if q["id"] == "90.exercise")
    assert ex["points"] == 1.0 and [c["passed"] for c in ex["cases"]] == [True, False]
    assert r["points"] == FULL - 1.0


@pytest.mark.timeout(600)
def test_report_and_gradebook_for_a_folder(ordinary):
    proc, results = ordinary
    assert proc.returncode == 0, proc.stderr
    assert "partial.ipynb  (90_fixture): 4 / 8 points" in proc.stdout
    assert "graded 5 of 5 submission(s)" in proc.stdout
    folder = Path(next(iter(results.values()))["submission"]).parent
    rows = {Path(r["submission"]).name: r for r in csv.DictReader(open(folder / "gradebook.csv"))}
    assert rows["partial.ipynb"]["points"] == "4" and rows["partial.ipynb"]["90.exercise"] == "1"
    assert rows["solved.ipynb"]["points"] == "8"
    # graded two at a time (--jobs 2), reported in the submissions' order
    names = sorted(p.name for p in folder.glob("*.ipynb"))
    assert list(rows) == list(results) == names
    assert [proc.stdout.index(f"== {folder / n}") for n in names] == sorted(
        proc.stdout.index(f"== {folder / n}") for n in names)


# ---------------------------------------------------------------- hostile
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, status, detail", [
    ("loop", "timeout", "ran past the 3 s limit and was interrupted"),
    ("sysexit", "error", "SystemExit: 3"),
    ("ranks_spin", "timeout", "ran past the 3 s limit and was interrupted"),
])
def test_hostile_cells_are_survived_and_later_answers_still_graded(hostile, name, status, detail):
    r = hostile[1][f"{name}.ipynb"]
    bad = [c for c in r["cells"] if c["status"] != "ok"]
    assert [(c["cell"], c["status"], c["detail"]) for c in bad] == [(3, status, detail)]
    assert r["points"] == FULL, format_report(r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, detail", [
    ("sigint", "ignored the interrupt"),
    ("osexit", "killed the kernel (exit code 3)"),
    ("exit", "called exit()"),
])
def test_a_cell_that_kills_the_kernel_is_skipped_on_a_rerun(hostile, name, detail):
    r = hostile[1][f"{name}.ipynb"]
    [skipped] = [c for c in r["cells"] if c["status"] != "ok"]
    assert skipped["cell"] == 3 and skipped["status"] == "skipped" and detail in skipped["detail"]
    assert any(detail in note and "run again" in note for note in r["notes"]), r["notes"]
    assert r["points"] == FULL, format_report(r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, error", [
    ("empty", "the file is empty (0 bytes)"),
    ("truncated", "the notebook is truncated"),
    ("not_a_notebook", "not a notebook: valid JSON, but without a list of cells"),
    ("binary", "not a notebook: the file is binary"),
])
def test_unreadable_files_get_a_clear_error_and_the_rest_are_graded(hostile, name, error):
    proc, results, tmp = hostile
    r = results[f"{name}.ipynb"]
    assert r["status"] == "error" and error in r["error"]
    assert f"NOT GRADED: {r['error']}" in proc.stdout
    assert proc.returncode == 1
    assert "graded 6 of 10 submission(s); 4 could not be graded" in proc.stdout
    rows = {Path(row["submission"]).name: row for row in csv.DictReader(open(tmp / "book.csv"))}
    assert rows[f"{name}.ipynb"]["status"] == "error" and rows["loop.ipynb"]["points"] == "8"


@pytest.fixture(scope="module", autouse=True)
def _no_warm_ranks_after():
    yield
    import labkit as lk
    lk.shutdown()   # grade_notebook in this process runs checkers on warm ranks


# ------------------------------------------------------- no kernels needed
@pytest.mark.parametrize("data, message", [
    (b"   \n", "the file is empty"),
    (b'{"cells": [', "truncated"),
    (b'{"cells": [tru', "truncated"),
    (b'{"cells": ["\\ud83d\\ude0', "truncated"),
    (b'{"cells": ]}', "not a valid notebook: its JSON breaks at line 1, column 11 of 1 lines"),
    (b'{"cells": []} x', "not a valid notebook: its JSON breaks at line 1, column 15 of 1 lines"),
    (b"[1, 2]", "without a list of cells"),
    (b'{"cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": 3}',
     "not a readable notebook"),
])
def test_read_submission_errors(tmp_path, data, message):
    path = tmp_path / "x.ipynb"
    path.write_bytes(data)
    with pytest.raises(SubmissionError, match=message):
        read_submission(path)


@pytest.mark.parametrize("name", ["00_setup", "03_ring_allreduce", "05_torchrun"])
def test_a_notebook_cut_anywhere_is_called_truncated(tmp_path, name):
    """Every cut point of a real notebook (here 100 per notebook, multi-byte characters too)."""
    import random

    data = (ROOT / "notebooks" / f"{name}.ipynb").read_bytes()
    rng = random.Random(name)
    path = tmp_path / "x.ipynb"
    for cut in sorted(rng.sample(range(1, len(data) - 2), 100)):
        path.write_bytes(data[:cut])
        with pytest.raises(SubmissionError, match="the notebook is truncated"):
            read_submission(path)


@pytest.mark.parametrize("garbage", ['"', "{{", "<<<<<<< HEAD"])
def test_garbage_in_the_middle_is_not_called_truncated(tmp_path, garbage):
    """A whole notebook whose JSON breaks halfway (a bad merge, a hand edit) is named by where
    it breaks, whatever its quotes and brackets add up to (an odd quote or an open bracket
    made the old check call it truncated at its last line)."""
    lines = (ROOT / "solutions" / "08_capstone.ipynb").read_text().split("\n")
    middle = len(lines) // 2
    lines[middle] = garbage + lines[middle]
    path = tmp_path / "x.ipynb"
    path.write_text("\n".join(lines))
    with pytest.raises(SubmissionError) as info:
        read_submission(path)
    assert str(info.value).startswith(f"not a valid notebook: its JSON breaks at line "
                                      f"{middle + 1}, column "), info.value
    assert f"of {len(lines)} lines" in str(info.value) and "truncated" not in str(info.value)


def test_bank_detection_order():
    banks = all_banks(BANKS)
    cell = nbformat.v4.new_code_cell('lk.quiz.check("90.single", 1)')
    nb = nbformat.v4.new_notebook(cells=[cell])
    assert bank_for(nb, Path("anything.ipynb"), banks, None).name == "90_fixture"   # ids
    assert bank_for(nbformat.v4.new_notebook(), Path("bob_90_fixture.ipynb"), banks, None).name \
        == "90_fixture"                                                                # file name
    with pytest.raises(SubmissionError, match="cannot tell which notebook this is"):
        bank_for(nbformat.v4.new_notebook(), Path("x.ipynb"), banks, None)
    with pytest.raises(SubmissionError, match="--bank 42_x: no such bank"):
        bank_for(nb, Path("x.ipynb"), banks, "42_x")


def _exercise_bank(tmp_path):
    from labkit.grading.bank import load_bank

    (tmp_path / "91_t.toml").write_text(
        '[[question]]\nid = "91.ex"\nkind = "exercise"\nprompt = "p"\nvariable = "f"\n'
        'checker = "checks.py:check"\n\n'
        '[[question]]\nid = "91.n"\nkind = "numeric"\nprompt = "p"\nvariable = "q_n"\n'
        'answer = 6\n')
    (tmp_path / "checks.py").write_text(
        "from labkit.grading.exercise import case\n"
        "def check(fn):\n    return [case('calls fn here', fn)]\n")   # no lk.run: no deadline
    return load_bank(tmp_path / "91_t.toml")


@pytest.mark.timeout(120)
def test_a_check_that_never_ends_is_stopped_by_the_grader(tmp_path):
    import cloudpickle

    from labkit.grading.grader import Options, score_bank

    def forever():
        while True:
            pass
    collected = {"f": ("pickle", cloudpickle.dumps(forever)), "q_n": ("ok", 6)}
    s = {x.id: x for x in score_bank(_exercise_bank(tmp_path), collected,
                                          Options(check_timeout=1))}
    assert s["91.ex"].status == "error" and "ran past 1 s and was stopped" in s["91.ex"].feedback
    assert s["91.n"].correct


@pytest.mark.timeout(120)
def test_a_crafted_pickle_never_runs_code_in_the_grader(tmp_path):
    """A submission whose answers unpickle into code: it can run only in the checker process."""
    import os

    import cloudpickle

    from labkit.grading.grader import Options, score_bank

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):   # loading this object appends the loading process's pid
            return (os.system, (f"echo $PPID >> {marker}",))
    evil = cloudpickle.dumps(Evil())
    collected = {"f": ("pickle", evil), "q_n": ("pickle", evil)}   # as an answer, too
    s = {x.id: x for x in score_bank(_exercise_bank(tmp_path), collected,
                                          Options(check_timeout=5))}
    assert s["91.n"].status == "error" and "not plain data" in s["91.n"].feedback
    assert s["91.ex"].status == "wrong" and "must be a function" in s["91.ex"].feedback
    ran_in = [int(line) for line in marker.read_text().split()]
    assert ran_in and os.getpid() not in ran_in, ran_in   # loaded once: in the checker process


def test_cli_usage_errors(tmp_path):
    cmd = [sys.executable, "-m", "labkit", "grade"]
    missing = subprocess.run(cmd + [str(tmp_path / "nope.ipynb")], capture_output=True, text=True)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    nobanks = subprocess.run(cmd + [str(SOLVED), "--bank-dir", str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert nobanks.returncode == 2 and "no question banks" in nobanks.stderr
    bad = subprocess.run(cmd + [str(SOLVED), "--jobs", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--jobs: must be a whole number of at least 1" in bad.stderr
    for jobs in ("-1", "two", "1.5"):                  # the same parser, without a process each
        with pytest.raises(SystemExit):
            grader._parser().parse_args([str(SOLVED), "--jobs", jobs])


# The lab's own notebooks are graded in the same run as nbval executes them (one execution,
# two verdicts): labkit/pytest_plugin.py adds a `grade` item after each notebook's last cell,
# full marks for solutions/, zero ("unanswered"/"not done") for notebooks/. Its ability to fail
# is tested in tests/grading/test_pytest_plugin.py.
