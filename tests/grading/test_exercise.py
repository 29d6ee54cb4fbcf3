"""Exercise checks: cases, "not done yet" for stubs, real multi-process checkers."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import assert_no_ranks_left

import labkit as lk
from labkit.grading.exercise import Case, NotDone, case, evaluate, is_not_done

FIXTURE_BANKS = Path(__file__).parent / "fixtures" / "quizzes"


@pytest.fixture(autouse=True)
def fixture_banks(monkeypatch):
    monkeypatch.setenv("LABKIT_QUIZ_DIR", str(FIXTURE_BANKS))


# ------------------------------------------------- sum_ranks answers (checker: 2 and 3 ranks)
def solved(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def right_on_two_ranks_only(rank, world_size):
    return 3.0


def stub(rank, world_size):
    raise NotImplementedError("sum_ranks: write your code here")


def deadlocks_on_three(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    if world_size == 2 or rank == 0:     # with 3 ranks only rank 0 joins: it waits forever
        dist.all_reduce(t)
    return t.item()


def crashes(rank, world_size):
    import os
    os._exit(3)


# ----------------------------------------------------------------- case()
def test_case_turns_outcomes_into_cases():
    assert case("ok", lambda: None) == Case("ok", True, "")
    assert case("ok", lambda: "max diff 0") == Case("ok", True, "max diff 0")

    def wrong():   # (raise, not assert: pytest rewrites asserts in test files)
        raise AssertionError("rank 1 got 1, expected 2")
    assert case("w", wrong) == Case("w", False, "rank 1 got 1, expected 2")
    assert case("e", lambda: {}["k"]) == Case("e", False, "KeyError: 'k'")

    def not_yet():
        raise NotImplementedError("write it")
    with pytest.raises(NotDone):
        case("n", not_yet)


@pytest.mark.timeout(60)
def test_a_stub_inside_a_rank_is_not_done_and_other_rank_errors_are_not():
    with pytest.raises(lk.RankError) as err:
        lk.run(stub, 2, echo=False)
    assert is_not_done(err.value)
    with pytest.raises(lk.RankError) as err:
        lk.run(lambda rank, world_size: 1 / 0, 2, echo=False)
    assert not is_not_done(err.value)
    assert_no_ranks_left()


# -------------------------------------------------------------- evaluate()
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn, status, points, detail", [
    (solved, "correct", 2.0, ""),
    (right_on_two_ranks_only, "partial", 1.0, "ranks returned [3.0, 3.0, 3.0], expected 6.0"),
    (stub, "not done", 0.0, ""),
    (deadlocks_on_three, "partial", 1.0, "rank 0 raised RuntimeError"),  # gloo timeout
    (crashes, "wrong", 0.0, "exited with code 3"),
])
def test_evaluate_runs_the_real_checker(fn, status, points, detail):
    s = evaluate("90.exercise", fn)
    assert (s.status, s.points, s.max_points) == (status, points, 2.0), s.text()
    assert detail in s.text()
    if status == "not done":
        assert s.cases == [] and "still raises NotImplementedError" in s.feedback
    if fn in (stub, deadlocks_on_three, crashes):   # failed jobs leave no rank behind
        assert_no_ranks_left()


def test_evaluate_answers_that_are_not_functions():
    assert evaluate("90.exercise", None).status == "unanswered"
    s = evaluate("90.exercise", 42)
    assert s.status == "wrong" and "must be a function, got int" in s.feedback


def bank_with_checker(tmp_path, body: str) -> None:
    (tmp_path / "91_t.toml").write_text(textwrap.dedent('''
        [[question]]
        id = "91.ex"
        kind = "exercise"
        prompt = "p"
        variable = "f"
        checker = "checks.py:check"
        partial = false
    '''))
    (tmp_path / "checks.py").write_text(textwrap.dedent(body))


@pytest.mark.parametrize("body, status, text", [
    ("def check(fn):\n    return 'all good'\n", "error", "not a non-empty list of Case"),
    ("def check(fn):\n    return []\n", "error", "not a non-empty list of Case"),
    ("def check(fn):\n    fn(1, 2, 3)\n", "error", "the check stopped: TypeError"),
    ("def nothing(fn):\n    pass\n", "error", "cannot be loaded"),
    ("from labkit.grading.exercise import Case\n"
     "def check(fn):\n    return [Case('a', True), Case('b', fn())]\n", "wrong",
     "1 of 2 cases pass"),
])
def test_checker_mistakes_and_all_or_nothing_scoring(tmp_path, monkeypatch, body, status, text):
    monkeypatch.setenv("LABKIT_QUIZ_DIR", str(tmp_path))
    bank_with_checker(tmp_path, body)
    s = evaluate("91.ex", lambda: False)
    assert s.status == status and s.points == 0.0 and text in s.feedback, s.text()


def test_all_failed_cases_mentioning_not_implemented_mean_not_done(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_QUIZ_DIR", str(tmp_path))
    bank_with_checker(tmp_path, "from labkit.grading.exercise import Case\ndef check(fn):\n"
                                "    return [Case('a', False, 'NotImplementedError: write f')]\n")
    assert evaluate("91.ex", lambda: 0).status == "not done"


@pytest.mark.timeout(60)
def test_check_prints_a_per_case_report_and_never_raises(capsys):
    s = lk.exercise.check("90.exercise", right_on_two_ranks_only)
    out = capsys.readouterr().out
    assert s.status == "partial"
    assert out.splitlines()[:3] == [
        "◐ 90.exercise: 1 of 2 cases pass (1/2)", "    ✓ 2 ranks",
        "    ✗ 3 ranks: ranks returned [3.0, 3.0, 3.0], expected 6.0 on each"]
    lk.exercise.check("90.exercise", stub)
    assert "… 90.exercise: not done yet" in capsys.readouterr().out
    lk.quiz.check("90.exercise", stub)   # the quiz entry point delegates to exercises
    assert "not done yet" in capsys.readouterr().out
    assert lk.exercise.check("90.missing", stub).status == "error"
