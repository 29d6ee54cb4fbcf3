"""Quiz banks and scoring: pure logic, no processes (labkit.grading: bank, scoring, quiz, the form)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import labkit as lk
from labkit.grading.bank import BankError, all_banks, load_bank

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_BANKS = Path(__file__).parent / "fixtures" / "quizzes"


@pytest.fixture(autouse=True)
def fixture_banks(monkeypatch):
    monkeypatch.setenv("LABKIT_QUIZ_DIR", str(FIXTURE_BANKS))


def write_bank(folder: Path, body: str, name: str = "91_t.toml") -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


Q = """
[[question]]
id = "91.q"
kind = "{kind}"
prompt = "p"
variable = "q_x"
{extra}
"""


# ------------------------------------------------------------------ banks
@pytest.mark.parametrize("kind, extra, message", [
    ("numeric", "answer = 1\nanswr = 2", "unknown field(s) ['answr']"),
    ("numerc", "answer = 1", "kind must be one of"),
    ("single", 'choices = ["a", "b"]\nanswer = "c"', "'c' is not one of the choices"),
    ("single", 'choices = ["a"]\nanswer = "a"', "2 to 26 distinct choices"),
    ("multi", 'choices = ["a", "b"]\nanswer = "a"', "non-empty list"),
    ("numeric", "", "exactly one of answer"),
    ("numeric", 'answer = 1\nkey = "m:f"', "exactly one of answer"),
    ("numeric", 'answer = "six"', "must be a number"),
    ("numeric", "answer = 1\npoints = 0", "points must be a positive number"),
    ("numeric", "answer = 1\ntolerance = -1", "tolerance must be a number >= 0"),
    ("numeric", 'key = "no_colon"', "must name a function"),
    ("numeric", 'answer = 1\ninputs = ["trace"]', "inputs are passed to a key"),
    ("exercise", "", "needs checker"),
    ("exercise", 'checker = "m:f"\nanswer = 1', "remove answer/key"),
    ("short", "answer = 3", "a short answer is a string"),
])
def test_malformed_banks_fail_loudly_with_file_question_and_fix(tmp_path, kind, extra, message):
    path = write_bank(tmp_path, Q.format(kind=kind, extra=extra))
    with pytest.raises(BankError) as err:
        load_bank(path)
    assert message in str(err.value)
    assert str(path) in str(err.value) and "91.q" in str(err.value)


def test_bank_rejects_ids_from_another_notebook_and_duplicates(tmp_path):
    body = Q.format(kind="numeric", extra="answer = 1")
    with pytest.raises(BankError, match="must start with this bank's number '92.'"):
        load_bank(write_bank(tmp_path, body, "92_other.toml"))
    with pytest.raises(BankError, match="appears twice"):
        load_bank(write_bank(tmp_path, body + body.replace("q_x", "q_y")))
    with pytest.raises(BankError, match="both use variable 'q_x'"):
        load_bank(write_bank(tmp_path, body + body.replace('"91.q"', '"91.r"')))
    with pytest.raises(BankError, match="not valid TOML"):
        load_bank(write_bank(tmp_path, "[[question]\n"))


def test_exercises_may_share_their_function(tmp_path):
    """Several rubric items graded on one function (notebook 08's capstone pieces); a quiz
    answer may not share its variable, not even with an exercise."""
    ex = Q.format(kind="exercise", extra='checker = "m:f"').replace("q_x", "fn")
    bank = load_bank(write_bank(tmp_path, ex + ex.replace('"91.q"', '"91.r"')))
    assert [q.variable for q in bank.questions.values()] == ["fn", "fn"]
    assert bank.names == ["fn"] and bank.pickled == {"fn"}
    quiz = Q.format(kind="numeric", extra="answer = 1").replace("q_x", "fn").replace('"91.q"',
                                                                                     '"91.r"')
    with pytest.raises(BankError, match="both use variable 'fn'"):
        load_bank(write_bank(tmp_path, ex + quiz))


def test_every_bank_in_the_repository_loads():
    banks = all_banks(ROOT / "quizzes")
    assert "00_setup" in banks
    for bank in banks.values():
        assert bank.questions, f"{bank.path} has no questions"


def test_bank_reloads_when_edited(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_QUIZ_DIR", str(tmp_path))
    path = write_bank(tmp_path, Q.format(kind="numeric", extra="answer = 1"))
    assert lk.quiz.score("91.q", 1).correct
    path.write_text(path.read_text().replace("answer = 1", "answer = 2\n# edited"))
    assert lk.quiz.score("91.q", 2).correct


def test_unknown_question_ids_are_named():
    with pytest.raises(BankError, match="no question '90.nope' in 90_fixture.toml"):
        lk.quiz.get("90.nope")
    with pytest.raises(BankError, match="is not a question id"):
        lk.quiz.get("ring_steps")


# ---------------------------------------------------------------- scoring
@pytest.mark.parametrize("qid, answer, status", [
    ("90.single", "a", "correct"), ("90.single", "A", "correct"),
    ("90.single", " gloo ", "correct"),
    ("90.single", "b", "wrong"), ("90.single", "z", "wrong"), ("90.single", 0, "wrong"),
    ("90.multi", "ac", "correct"), ("90.multi", "a, c", "correct"),
    ("90.multi", ["c", "a"], "correct"),
    ("90.multi", ["all_reduce", "broadcast"], "correct"), ("90.multi", "a", "wrong"),
    ("90.multi", "abc", "wrong"), ("90.multi", 3, "wrong"),
    ("90.numeric", 6, "correct"), ("90.numeric", 6.009, "correct"), ("90.numeric", "6", "correct"),
    ("90.numeric", 6.02, "wrong"), ("90.numeric", True, "wrong"),
    ("90.numeric", float("nan"), "wrong"),
    ("90.short", "All-Reduce.", "correct"), ("90.short", "  allreduce ", "correct"),
    ("90.short", "broadcast", "wrong"), ("90.short", 6, "wrong"),
    ("90.numeric", None, "unanswered"), ("90.single", None, "unanswered"),
])
def test_score_each_kind(qid, answer, status):
    s = lk.quiz.score(qid, answer)
    assert s.status == status, s.feedback
    q = lk.quiz.get(qid)
    assert s.points == (q.points if status == "correct" else 0.0)
    assert s.max_points == q.points


def test_numeric_accepts_numpy_and_torch_scalars():
    import numpy as np
    import torch

    assert lk.quiz.score("90.numeric", np.float32(6.0)).correct
    assert lk.quiz.score("90.numeric", torch.tensor(6.0)).correct
    assert not lk.quiz.score("90.numeric", torch.tensor([6.0, 1.0])).correct


def test_computed_question_uses_the_key_on_the_learners_inputs():
    assert lk.quiz.score("90.computed", 7.0, {"measured": [1.5, 2.5, 3.0]}).correct
    assert lk.quiz.score("90.computed", 7.0, {"measured": [1.0]}).status == "wrong"
    missing = lk.quiz.score("90.computed", 7.0, {})
    assert missing.status == "error" and "needs your variable 'measured'" in missing.feedback
    rejected = lk.quiz.score("90.computed", 7.0, {"measured": "oops"})
    assert rejected.status == "error" and "ValueError: measured must be" in rejected.feedback


def test_wrong_answer_shows_hint_and_explanation():
    s = lk.quiz.score("90.numeric", 5)
    assert "you answered 5" in s.feedback and "Two phases of N-1 steps" in s.feedback
    assert "2(N-1) = 6" in s.text()
    assert lk.quiz.score("90.numeric", None).explanation == ""   # nothing revealed unanswered


# --------------------------------------------------------- notebook glue
def test_check_prints_feedback_and_never_raises(capsys):
    s = lk.quiz.check("90.numeric", q_numeric)
    out = capsys.readouterr().out
    assert s.correct and out.startswith("✓ 90.numeric: correct (1/1)") and "Note" not in out
    assert lk.quiz.check("90.numeric", None).status == "unanswered"
    assert "not answered yet" in capsys.readouterr().out
    assert lk.quiz.check("90.nope", 1).status == "error"
    assert "cannot check this question" in capsys.readouterr().out


# Module globals play the notebook's namespace (a notebook's variables are globals).
q_numeric, q_computed, measured = 6, 7.0, [3.5, 3.5]


def test_check_reads_the_bank_variable_and_key_inputs_like_a_notebook(capsys):
    assert lk.quiz.check("90.computed").correct          # q_computed and measured from globals
    assert lk.quiz.check("90.computed", 7.0, measured=[7.0]).correct   # explicit inputs win
    assert not lk.quiz.check("90.computed", 7.0, measured=[1.0]).correct


def test_check_warns_when_the_graded_variable_differs(capsys):
    lk.quiz.check("90.single", "a")          # q_single is not set in this module
    assert "the grader reads the variable q_single" in capsys.readouterr().out


def test_score_displays_nothing_in_ipython_but_has_a_repr():
    s = lk.quiz.score("90.numeric", 6)
    assert s._ipython_display_() is None
    assert repr(s) == "Score('90.numeric', 1/1, 'correct')"


def test_expect_solved_turns_wrong_checks_into_assertions(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_EXPECT_SOLVED", "1")
    with pytest.raises(AssertionError, match="90.numeric is wrong"):
        lk.quiz.check("90.numeric", 5)
    lk.quiz.check("90.numeric", 6)


def test_form_submit_shows_feedback_and_the_line_to_write():
    f = lk.quiz.form("90.multi")
    f.set_answer("ac")
    f.button.click()                          # the real callback, no kernel needed
    assert f.last.correct and "correct" in f.feedback.value
    assert "q_multi = [&#x27;a&#x27;, &#x27;c&#x27;]" in f.feedback.value
    assert "labkit-quiz" in f.widget._dom_classes


@pytest.mark.parametrize("qid, answer, status", [
    ("90.single", "b", "wrong"), ("90.numeric", "6", "correct"), ("90.numeric", "six", "wrong"),
    ("90.short", "allreduce", "correct"), ("90.numeric", "", "unanswered"),
])
def test_form_kinds(qid, answer, status):
    f = lk.quiz.form(qid)
    f.set_answer(answer)
    assert f.submit().status == status


def test_form_for_an_exercise_points_to_the_check():
    f = lk.quiz.form("90.exercise")
    assert f.button.disabled and "lk.exercise.check" in f.input.value


def _length_rule_hits(banks) -> tuple[list[str], list[str], int, int]:
    """Which single-choice keys are the one longest choice, and which multi-choice keys are
    exactly the choices left after dropping (or keeping) the k longest: a learner who answers
    by length alone gets those right."""
    single, multi, n_single, n_multi = [], [], 0, 0
    for bank in banks.values():
        for q in bank.questions.values():
            if q.kind not in ("single", "multi"):
                continue
            size = [len(c) for c in q.choices]
            keys = {q.choices.index(a) for a in ([q.answer] if q.kind == "single" else q.answer)}
            if q.kind == "single":
                n_single += 1
                [k] = keys
                if size[k] == max(size) and size.count(max(size)) == 1:
                    single.append(q.id)
                continue
            n_multi += 1
            longest_first = sorted(range(len(size)), key=lambda i: -size[i])
            if any(keys in (set(longest_first[k:]), set(longest_first[:k]))
                   for k in range(1, len(size))):
                multi.append(q.id)
    return single, multi, n_single, n_multi


def test_no_length_rule_passes_the_banks():
    """Issue 25: keys that are visibly the longest, most hedged option give the answer away, and
    so does the reverse. Answering "the longest" (single) or "drop/keep the k longest" (multi)
    must not score more than a third of the questions."""
    single, multi, n_single, n_multi = _length_rule_hits(all_banks(ROOT / "quizzes"))
    assert len(single) <= n_single / 3, f"the longest choice is the key in {single}"
    assert len(multi) <= n_multi / 3, f"a length rule gives the keys of {multi}"


def test_the_length_rule_check_sees_a_key_that_is_always_the_longest():
    from types import SimpleNamespace as Q
    long_key = Q(id="99.a", kind="single", choices=("no", "yes, because it is longer"),
                 answer="yes, because it is longer")
    drop_longest = Q(id="99.b", kind="multi", choices=("ab", "cd", "a much longer wrong one"),
                     answer=["ab", "cd"])
    fair = Q(id="99.c", kind="multi", choices=("short right", "a longer right one", "a mid wrong one"),
             answer=["short right", "a longer right one"])
    bank = Q(questions={q.id: q for q in (long_key, drop_longest, fair)})
    assert _length_rule_hits({"99": bank}) == (["99.a"], ["99.b"], 1, 2)
