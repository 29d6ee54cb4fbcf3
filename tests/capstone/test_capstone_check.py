"""Notebook 08's capstone grader: the solution passes every rubric item; lazy and wrong pieces fail theirs.

Each answer set in capstone_answers.py is graded by really launching ``train_gpt.py --pieces``
under torchrun, as the notebook and ``python -m labkit grade`` do. To keep this file short in
wall time, the wrong pieces travel in pairs (a wrong evaluation with a wrong checkpoint: they
are judged on different evidence, the evaluation at step 3 happens before any checkpoint is
loaded) and the five gradings run at the same time (the machine mostly waits on process starts).

The solution's full marks are not graded again here: ``solutions/08_capstone.ipynb`` grades
it in every test run, through the same checkers, in its check cell (``LABKIT_EXPECT_SOLVED``
turns any item short of full marks into a failure); its ``grade`` item then keeps that Score
(tests/grading/test_pytest_plugin.py shows both can fail).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import pytest

import capstone_answers as A
from capstone_common import no_ranks_at_the_end
from labkit.capstone import _check_runs as R
from labkit.capstone import check as C
from labkit.grading import exercise

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]

PLANS = {   # name: (pieces, rubric items to grade)
    "mean of means, no optimizer state": (A.pieces(
        all_reduce_sums=A.mean_of_rank_means, save_checkpoint=A.save_without_optimizer,
        load_checkpoint=A.load_without_optimizer), "abc"),
    "padding counted, no RNG state": (A.pieces(
        all_reduce_sums=A.padding_counted, save_checkpoint=A.save_without_rng,
        load_checkpoint=A.load_without_rng), "abc"),
    "no all-reduce, load ignores the checkpoint": (A.pieces(
        all_reduce_sums=A.rank_local, load_checkpoint=A.load_ignoring_the_checkpoint), "abc"),
    "a file per rank: same world size only": (A.pieces(
        save_checkpoint=A.save_rank_files, load_checkpoint=A.load_rank_files), "abcd"),
    "all_reduce on rank 0 only": (A.pieces(all_reduce_sums=A.all_reduce_on_rank_0), "c"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, dict]:
    """Every plan graded once, all at the same time (the reference run first, once)."""
    R.reference(tmp_path_factory.mktemp("reference"))
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(C.grade, fn, items) for name, (fn, items) in PLANS.items()}
        return {name: f.result() for name, f in futures.items()}


def failed(cases: dict, item: str) -> str:
    assert not cases[item].passed, f"({item}) should fail: {cases[item].detail}"
    return cases[item].detail


def test_mean_of_rank_means_and_a_save_without_the_optimizer(graded):
    cases = graded["mean of means, no optimizer state"]
    assert cases["a"].passed, cases["a"]              # training itself is not disturbed
    assert "the optimizer's state is not the saved one" in failed(cases, "b")
    assert "average of each rank's mean" in failed(cases, "c")


def test_padding_counted_and_a_save_without_the_rng(graded):
    cases = graded["padding counted, no RNG state"]
    assert cases["a"].passed, cases["a"]
    assert "RNG state is not the one at the save" in failed(cases, "b")
    detail = failed(cases, "c")
    assert "10 windows were counted, 1 of them DistributedSampler's padding" in detail


def test_no_all_reduce_and_a_load_that_ignores_the_checkpoint(graded):
    cases = graded["no all-reduce, load ignores the checkpoint"]
    assert cases["a"].passed, cases["a"]
    assert "the model's parameters are not the saved ones" in failed(cases, "b")
    assert "Each rank returned its own windows only" in failed(cases, "c")


def test_a_checkpoint_of_rank_files_resumes_but_does_not_reshard(graded):
    cases = graded["a file per rank: same world size only"]
    assert [c.name for c in cases.values()] == list(C.ITEMS.values())
    assert cases["a"].passed and cases["b"].passed, cases    # same world size: bit-identical
    assert "bit-identical" in cases["b"].detail, cases["b"]
    assert cases["c"].passed and "== one process" in cases["c"].detail, cases["c"]
    assert "load_checkpoint on 1 rank failed" in failed(cases, "d")


def test_a_deadlocked_all_reduce_fails_fast(graded):
    """all_reduce on rank 0 only: rank 0 waits forever; the checker stops the job after
    STEP_IDLE_S seconds without output (not gloo's 30-minute timeout) and nothing is left."""
    from labkit.runtime.torchrun import live_processes

    detail = failed(graded["all_reduce on rank 0 only"], "c")
    assert f"no output for {R.STEP_IDLE_S:.0f} s after rank 0 logged a step: a deadlock?" in detail
    assert live_processes() == []


def test_the_bank_checkers_share_one_grading(graded, monkeypatch):
    """The four rubric items come from one grading per set of pieces (cached), not four."""
    monkeypatch.setattr(C, "_run_cases", lambda *a: pytest.fail("graded again"))
    name = "a file per rank: same world size only"
    for check, item in zip((C.check_trains, C.check_resumes, C.check_evaluates,
                            C.check_reshards), "abcd"):
        assert check(PLANS[name][0]) == [graded[name][item]]


def test_the_cache_key_survives_the_graders_pickle_round_trip():
    """The grader loads the notebook's function once per item: the four loads share the key."""
    cloudpickle.register_pickle_by_value(A)
    try:
        blob = cloudpickle.dumps(A.solution)
    finally:
        cloudpickle.unregister_pickle_by_value(A)
    one, two = cloudpickle.loads(blob), cloudpickle.loads(blob)
    assert one is not two and C._digest(C.pieces_of(one)) == C._digest(C.pieces_of(two))


def test_stubs_are_not_done_without_launching(monkeypatch):
    def stub(*args, **kwargs):
        raise NotImplementedError("write your code here")

    monkeypatch.setattr(R, "learner_run", lambda *a, **k: pytest.fail("launched a stub"))
    pieces = lambda: {"all_reduce_sums": stub, "save_checkpoint": stub, "load_checkpoint": stub}
    score = exercise.evaluate("08.trains", pieces)
    assert score.status == "not done" and score.points == 0


@pytest.mark.parametrize("fn, words", [
    (42, "must be a function"),
    (lambda: {"all_reduce_sums": A.all_reduce_sums}, "exactly the keys"),
    (lambda: {**A.solution(), "save_checkpoint": "save"}, "not a function"),
    (lambda: {**A.solution(), "all_reduce_sums": __import__(
        "labkit.capstone.evaluate", fromlist=["x"]).all_reduce_sums}, "the project's own"),
])
def test_a_bundle_that_is_not_three_pieces_fails_every_item_at_once(fn, words, monkeypatch):
    monkeypatch.setattr(R, "learner_run", lambda *a, **k: pytest.fail("launched"))
    cases = C.grade(fn)
    assert not any(c.passed for c in cases.values()) and words in cases["a"].detail
