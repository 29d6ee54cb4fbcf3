"""The DDP-by-hand checker: right answers pass, classic mistakes fail with a clear message."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import labkit as lk
from labkit.ddp import BucketedDDP, NaiveDDP, ReplicatedModule
from labkit.ddp.check import check_average_gradients, check_ddp_wrapper

from conftest import assert_no_ranks_left

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(60)


def right(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def summed(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def ignores_frozen(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)


def reduce_to_rank0(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.reduce(p.grad, dst=0)
            p.grad /= dist.get_world_size()


def rank0_only(model):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


def nothing(model):
    pass


def stub(model):
    raise NotImplementedError("average_gradients: write your code here")


def test_the_right_answer_passes_every_world_size():
    cases = check_average_gradients(right)
    assert [c.name for c in cases] == ["2 ranks", "3 ranks", "4 ranks"]
    assert all(c.passed for c in cases), cases
    assert "all 3 steps" in cases[0].detail


@pytest.mark.parametrize("answer, words", [
    (summed, "you summed the gradients"),
    (ignores_frozen, "frozen layer"),
    (reduce_to_rank0, "Rank 0 matches but rank"),
    (nothing, "still this rank's local gradient"),
])
def test_each_classic_mistake_fails_with_a_message_that_names_the_fix(answer, words):
    cases = check_average_gradients(answer, world_sizes=(2, 4))
    assert not any(c.passed for c in cases)
    assert words in cases[0].detail, cases[0].detail


@pytest.mark.timeout(40)   # fast: the checker's own 3 s collective timeout, not pytest's
def test_a_deadlocked_answer_fails_fast_names_the_line_and_leaves_no_rank():
    cases = check_average_gradients(rank0_only)
    assert not any(c.passed for c in cases)
    assert "deadlock" in cases[0].detail and "rank 0" in cases[0].detail
    assert "dist.all_reduce(p.grad)" in cases[0].detail       # the learner's own line
    assert cases[1].detail.startswith("not run")
    assert_no_ranks_left()


def test_a_stub_reports_not_done_through_lk_exercise():
    with pytest.raises(NotImplementedError):
        check_average_gradients(stub)
    score = lk.exercise.evaluate("02.average_gradients", stub)
    assert score.status == "not done", score


class AfterBackward(ReplicatedModule):
    """Right numbers, every gradient averaged after backward: no overlap."""

    def finish_gradient_synchronization(self):
        right(self.module)


def test_the_wrapper_check_demands_overlap():
    naive = check_ddp_wrapper(AfterBackward, world_sizes=(2,))
    assert not naive[0].passed and "no overlap" in naive[0].detail


def test_the_lab_s_own_wrappers_are_refused_by_name():
    """lk's BucketedDDP overlaps and is right: it passed every case before the checker counted
    the lab's own implementations (labkit.grading.references)."""
    for cls, name in ((lambda m: BucketedDDP(m, bucket_cap_mb=0), "BucketedDDP._launch"),
                      (NaiveDDP, "NaiveDDP.finish_gradient_synchronization")):
        case = check_ddp_wrapper(cls, world_sizes=(2,))[0]
        assert not case.passed and "the lab's own implementation did the work" in case.detail
        assert name in case.detail, case.detail


def test_no_rank_outlives_the_checks():
    lk.shutdown()
    assert_no_ranks_left()
