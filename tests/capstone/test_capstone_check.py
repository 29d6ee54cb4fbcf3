"""Notebook 08's capstone grader: the solution passes every rubric item; lazy and wrong pieces fail theirs.

Each answer in capstone_answers.py is graded by really launching ``train_gpt.py --pieces``
under torchrun, as the notebook and ``python -m labkit grade`` do. The notebook grades its
``all_reduce_sums`` alone (item (c), §5, the core path: :func:`labkit.capstone.check.check_evaluates`)
and its ``capstone_pieces`` (the two checkpoint functions) for (a), (b) and (d) (§10); two
shortcuts of the evaluation go through (c)'s own checker, as the notebook calls it. To keep
this file short in wall time, the other wrong pieces travel in pairs (a wrong evaluation with a
wrong checkpoint, graded in one run: they are judged on different evidence, the evaluation at
step 3 happens before any checkpoint is loaded) and the gradings run four at a time (the
machine mostly waits on process starts). Every class of shortcut has its answer: state hidden
in memory, the project's own code doing the work, a side channel (the store, a file), an
evaluation not split over the ranks. The evaluation's feedback for each known mistake is
judged on lab ranks, without torchrun (the end of this file).

The solution's full marks are not graded again here: ``solutions/08_capstone.ipynb`` grades
it in every test run, through the same checkers, in its check cell (``LABKIT_EXPECT_SOLVED``
turns any item short of full marks into a failure); its ``grade`` item then keeps that Score
(tests/grading/test_pytest_plugin.py shows both can fail).
"""
from __future__ import annotations

import functools
import importlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cloudpickle
import pytest

import capstone_answers as A
from capstone_common import no_ranks_at_the_end
from labkit.capstone.check import runs as R
from labkit.capstone import check as C
from labkit.capstone.check import probes
from labkit.grading import exercise

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]

PLANS = {   # name: (pieces graded together, or an all_reduce_sums alone: "c"; rubric items)
    "mean of means, no optimizer state": (A.pieces(
        all_reduce_sums=A.mean_of_rank_means, save_checkpoint=A.save_without_optimizer,
        load_checkpoint=A.load_without_optimizer), "abc"),
    "padding counted, no RNG state": (A.pieces(
        all_reduce_sums=A.padding_counted, save_checkpoint=A.save_without_rng,
        load_checkpoint=A.load_without_rng), "abc"),
    "no all-reduce, a load from memory": (A.pieces(
        all_reduce_sums=A.rank_local, save_checkpoint=A.save_keeping_a_copy,
        load_checkpoint=A.load_from_memory), "abc"),
    "evaluated again on every rank, a side file": (A.pieces(
        all_reduce_sums=A.evaluated_again_everywhere, save_checkpoint=A.save_with_a_side_file,
        load_checkpoint=A.load_from_the_side_file), "abcd"),
    "sums through the store": (A.through_the_store, "c"),
    "the project's own save and load": (A.checkpoint_pieces(
        save_checkpoint=A.save_by_the_project, load_checkpoint=A.load_by_the_project), "abd"),
    "a file per rank: same world size only": (A.pieces(
        save_checkpoint=A.save_rank_files, load_checkpoint=A.load_rank_files), "abcd"),
    "all_reduce on rank 0 only": (A.all_reduce_on_rank_0, "c"),
}


def _grade(fn, items: str) -> dict:
    """As the notebook grades: an all_reduce_sums alone by (c)'s own bank checker; pieces by
    :func:`labkit.capstone.check.grade`."""
    return {"c": C.check_evaluates(fn)[0]} if items == "c" else C.grade(fn, items)


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, dict]:
    """Every plan graded once, all at the same time (the reference run first, once)."""
    R.reference(tmp_path_factory.mktemp("reference"))
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(_grade, fn, items) for name, (fn, items) in PLANS.items()}
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


def test_no_all_reduce_and_a_load_from_state_hidden_in_memory(graded):
    """Hidden state: a copy kept in memory by save_checkpoint is gone in the restarted
    processes, so the load restores nothing."""
    cases = graded["no all-reduce, a load from memory"]
    assert cases["a"].passed, cases["a"]
    detail = failed(cases, "b")
    assert "nothing was restored from the checkpoint (state kept in memory is gone" in detail
    assert "the model's parameters are not the saved ones" in detail
    assert "Each rank returned its own windows only" in failed(cases, "c")


def test_an_evaluation_not_split_and_a_checkpoint_kept_in_a_side_file(graded):
    """Not split: every rank evaluates every window itself (the right number, no all-reduce).
    Side channel: a file of its own beside the checkpoint, read by the load: it resumes on the
    same world size (b) but does not follow what the checkpoint folder holds (d)."""
    cases = graded["evaluated again on every rank, a side file"]
    assert cases["a"].passed and cases["b"].passed, cases
    assert "the evaluation was done again, not split over the ranks" in failed(cases, "c")
    detail = failed(cases, "d")
    assert "restored the state at the save, but not what the checkpoint folder holds" in detail
    assert "a file outside the checkpoint folder" in detail and "side channel" in detail


def test_sums_through_the_store_fail_the_core_paths_checker(graded):
    """Side channel, through (c)'s own checker (notebook 08 §5): the right sums through the
    process group's TCPStore, no collective."""
    detail = failed(graded["sums through the store"], "c")
    assert "ran no collective on any process group" in detail and "side channel" in detail


def test_the_projects_own_checkpoint_code_fails_by_name(graded):
    """The library doing the work: the project's own save and load, found at run time, as the
    notebook's capstone_pieces (the two checkpoint functions; the script evaluates with its own
    reduction, which is not the learner's and is not held against it)."""
    cases = graded["the project's own save and load"]
    assert list(cases) == ["a", "b", "d"] and cases["a"].passed, cases
    words = ("your pieces called labkit.capstone.sharded_checkpoint.load_checkpoint, "
             "labkit.capstone.sharded_checkpoint.save_checkpoint: the project's own")
    assert words in failed(cases, "b") and words in failed(cases, "d")


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
    """The three checkpoint items come from one grading of capstone_pieces (cached), not three;
    (c)'s checker reuses its own grading of the same all_reduce_sums."""
    monkeypatch.setattr(C, "_run_cases", lambda *a: pytest.fail("graded again"))
    name = "the project's own save and load"
    for check, item in zip((C.check_trains, C.check_resumes, C.check_reshards), "abd"):
        assert check(PLANS[name][0]) == [graded[name][item]]
    assert C.check_evaluates(A.through_the_store) == [graded["sums through the store"]["c"]]


def test_each_item_grades_only_the_pieces_it_judges(monkeypatch, tmp_path):
    """(c) ships the learner's all_reduce_sums alone (the script keeps its own checkpoint
    code); (a), (b), (d) ship capstone_pieces' two functions (the script evaluates with its
    own reduction); the probed pieces come first in the --pieces file, so the guard is in place
    before any of the learner's functions loads."""
    shipped = []
    monkeypatch.setattr(C, "_CACHE", {})            # nothing graded here is kept
    monkeypatch.setattr(C, "_run_cases", lambda pieces, work, items: shipped.append(
        (sorted(pieces), items)) or {i: exercise.Case(C.ITEMS[i], True) for i in items})
    C.check_evaluates(A.rank_local)
    C.check_trains(A.checkpoint_pieces(save_checkpoint=A.save_without_rng))
    assert shipped == [(["all_reduce_sums"], "c"), (["load_checkpoint", "save_checkpoint"], "abd")]
    for pieces, first in (({"all_reduce_sums": A.rank_local}, "all_reduce_sums"),
                          (A.checkpoint_pieces()(), "load_checkpoint")):
        blob = R.ship(pieces, tmp_path, tmp_path / "p.pkl").read_bytes()
        real = _guarded_functions()
        try:
            loaded = pickle.loads(blob)
        finally:
            for (m, a), f in real.items():
                setattr(importlib.import_module(m), a, f)
        assert list(loaded)[0] == first and set(loaded) == set(pieces)
        assert isinstance(loaded[first], functools.partial), loaded


def test_the_cache_key_survives_the_graders_pickle_round_trip():
    """The grader loads the notebook's function once per item: the three loads of
    capstone_pieces share the key (and two loads of an all_reduce_sums share theirs)."""
    cloudpickle.register_pickle_by_value(A)
    try:
        blob, reduction = cloudpickle.dumps(A.capstone_pieces), cloudpickle.dumps(A.all_reduce_sums)
    finally:
        cloudpickle.unregister_pickle_by_value(A)
    one, two = cloudpickle.loads(blob), cloudpickle.loads(blob)
    assert one is not two and C._digest(C.pieces_of(one)) == C._digest(C.pieces_of(two))
    one, two = cloudpickle.loads(reduction), cloudpickle.loads(reduction)
    assert C._digest({"all_reduce_sums": one}) == C._digest({"all_reduce_sums": two})


def test_stubs_are_not_done_without_launching(monkeypatch):
    """The untouched student notebook: its stubs are "not done", and nothing is launched."""
    def stub(*args, **kwargs):
        raise NotImplementedError("write your code here")

    monkeypatch.setattr(R, "learner_run", lambda *a, **k: pytest.fail("launched a stub"))
    pieces = lambda: {"save_checkpoint": stub, "load_checkpoint": stub}
    for qid, fn in (("08.evaluates", stub), ("08.trains", pieces), ("08.reshards", pieces)):
        score = exercise.evaluate(qid, fn)
        assert score.status == "not done" and score.points == 0, score


_PROJECTS = __import__("labkit.capstone.sharded_checkpoint", fromlist=["x"])


@pytest.mark.parametrize("fn, words", [
    (42, "must be a function"),
    (A.pieces(), "exactly the keys ['save_checkpoint', 'load_checkpoint']"),
    (lambda: {"save_checkpoint": A.save_checkpoint}, "exactly the keys"),
    (A.checkpoint_pieces(save_checkpoint="save"), "not a function"),
    (A.checkpoint_pieces(load_checkpoint=_PROJECTS.load_checkpoint), "the project's own"),
])
def test_capstone_pieces_not_the_two_checkpoint_functions_fail_every_item_at_once(
        fn, words, monkeypatch):
    monkeypatch.setattr(R, "learner_run", lambda *a, **k: pytest.fail("launched"))
    cases = C.grade(fn)
    assert list(cases) == ["a", "b", "d"], cases
    assert not any(c.passed for c in cases.values()) and words in cases["a"].detail


@pytest.mark.parametrize("fn, words", [
    (42, "all_reduce_sums is int, not a function"),
    (__import__("labkit.capstone.evaluate", fromlist=["x"]).all_reduce_sums,
     "the project's own: write your own all_reduce_sums"),
])
def test_an_all_reduce_sums_that_is_not_the_learners_fails_without_launching(fn, words,
                                                                             monkeypatch):
    monkeypatch.setattr(R, "learner_run", lambda *a, **k: pytest.fail("launched"))
    [case] = C.check_evaluates(fn)
    assert not case.passed and words in case.detail, case


# ------------------------------------------------------------------ (c) judged on lab ranks
# The evaluation's judge and its feedback, without torchrun: each answer runs in the project's
# own evaluate() on 2 warm lab ranks (gloo, the capstone's model and validation windows),
# wrapped by the grader's own probe (its disguise, its collective count, its guard).
EVALS = {"solution": A.all_reduce_sums, "rank 0 x world": A.rank_0_times_world,
         "padding": A.padding_counted, "local": A.rank_local, "means": A.mean_of_rank_means,
         "divided": A.divided_by_world, "float32": A.float32_sum,
         "again": A.evaluated_again_everywhere, "store": A.through_the_store,
         "project's own": A.the_projects_own}


def _guarded_functions() -> dict:
    return {(m, a): getattr(importlib.import_module(m), a)
            for m, attrs in probes.GUARDED.items() for a in attrs}


def _evaluate_on_rank(rank, world_size, answers, folder, secret):
    import torch

    from labkit.capstone import train_gpt as G
    from labkit.capstone.evaluate import evaluate
    from labkit.capstone.model import GPTConfig, make_gpt

    cfg = G.parse_args(R.ARGV)
    model = make_gpt(GPTConfig(cfg.block_size, 256, cfg.n_layer, cfg.n_head, cfg.n_embd,
                               cfg.dropout), seed=cfg.seed)
    _, val, _ = G._data(cfg)
    real = _guarded_functions()
    for name, fn in answers.items():
        sub = Path(folder) / name
        sub.mkdir(exist_ok=True)
        probes._install_guard(str(sub))
        try:
            reduce = functools.partial(probes.reduce_probe, probes.Guard(str(sub)), fn, str(sub),
                                       secret)
            evaluate(model, val, cfg.eval_batch, torch.device("cpu"), reduce=reduce)
        finally:                    # warm ranks stay: leave the project's functions as found
            for (m, a), f in real.items():
                setattr(importlib.import_module(m), a, f)
    return model.state_dict()


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> dict[str, str]:
    """What (c) says of each answer in EVALS (its _judge, then its guard)."""
    import labkit as lk

    folder = tmp_path_factory.mktemp("evals")
    res = lk.run(_evaluate_on_rank, 2, args=(EVALS, str(folder), 12345), echo=False,
                 backend="gloo", timeout=60, deadline=120)
    oracle, _, n = C._oracle(res.values[0])
    out = {}
    for name in EVALS:
        records = probes.read_evals(folder / name)
        assert len(records) == 2 and n == 9, records
        out[name] = C._judge(records, oracle, n, "step 3")
        try:
            C._not_the_projects(R.LearnerRun(None, folder, folder / name), "all_reduce_sums",
                                "labkit.capstone.evaluate.")
        except AssertionError as e:
            out[name] += f" | {e}"
    return out


def test_the_solution_is_judged_right_through_the_disguise(judged):
    assert judged["solution"] == ""


@pytest.mark.parametrize("name, words", [
    ("rank 0 x world", "Every rank got 2 x rank 0's own sums"),
    ("padding", "10 windows were counted, 1 of them DistributedSampler's padding duplicates"),
    ("local", "Each rank returned its own windows only"),
    ("means", "That is the average of each rank's mean"),
    ("divided", "The sums were averaged over the ranks"),
    ("float32", "Close, not equal: add in float64"),
])
def test_a_wrong_reduction_is_told_what_it_did(judged, name, words):
    """Each mistake named from the recorded inputs and outputs, and only that one: rank 0's
    sums times 2 count 10 windows too, and are not told about the padding."""
    assert words in judged[name], judged[name]
    assert ("padding" in judged[name]) == (name == "padding"), judged[name]


def test_an_evaluation_not_split_over_the_ranks_fails(judged):
    """Every rank evaluating every window itself gets the one-process number without
    communicating: the disguised inputs show it ignored what it was given."""
    assert "the evaluation was done again, not split over the ranks" in judged["again"], (
        judged["again"])


def test_sums_through_the_store_fail_as_a_side_channel(judged):
    assert "ran no collective on any process group" in judged["store"], judged["store"]
    assert "side channel" in judged["store"]


def test_the_projects_own_reduction_fails_however_it_is_found(judged):
    assert "your pieces called labkit.capstone.evaluate.all_reduce_sums" in judged[
        "project's own"], judged["project's own"]


def test_the_guard_is_unpickled_before_the_learners_pieces(tmp_path):
    """A piece that names the project's function at module level gets the recorder: the
    guard in the --pieces file comes first, so the by-reference lookup finds it."""
    real = _guarded_functions()
    pieces = A.pieces(all_reduce_sums=A.by_the_projects_name)()
    try:
        loaded = pickle.loads(R.ship(pieces, tmp_path, tmp_path / "p.pkl").read_bytes())
        inner = loaded["all_reduce_sums"].args[1]
        assert getattr(inner.__globals__["project_all_reduce_sums"], "_labkit_guarded", False)
    finally:
        for (m, a), f in real.items():
            setattr(importlib.import_module(m), a, f)
