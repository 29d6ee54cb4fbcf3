"""Notebook 06's checkers: the right answers pass; lazy and wrong answers fail a named case.

Each wrong answer in tests/sharding/sharding_answers.py is a mistake a learner makes; these tests
pin which case it fails and that the message names the fix. Each shortcut (issue 22: state
hidden in a closure, a library object doing the work, a copied oracle, a side channel, a
computation not split) fails a case whose message names it. Most run on 2 ranks only (the
cases are the same per world size); the right answers run on 2 and 4.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import labkit as lk
import sharding_answers as A
from labkit.sharding.check import check_parallel_mlp, check_sharded_linear, \
    check_sharded_optimizer

from conftest import assert_no_ranks_left

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)


def failed(cases, name_part: str) -> str:
    """The detail of the one failing case whose name contains ``name_part``."""
    hits = [c for c in cases if name_part in c.name]
    assert hits, [c.name for c in cases]
    bad = [c for c in hits if not c.passed]
    assert bad, f"expected {name_part!r} to fail: {hits}"
    return bad[0].detail


def passed(cases, name_part: str) -> bool:
    return all(c.passed for c in cases if name_part in c.name)


@pytest.mark.parametrize("check, answer, count", [
    (check_sharded_optimizer, A.ShardedOptimizer, 8),
    (check_sharded_linear, A.ShardedLinear, 6),
    (check_parallel_mlp, A.ParallelMLP, 6),
])
def test_the_solution_passes_every_case_on_2_and_4_ranks(check, answer, count):
    cases = check(answer)
    assert len(cases) == count and all(c.passed for c in cases), cases


# ------------------------------------------------------------- exercise 1: ZeRO-1
def test_a_plain_optimizer_fails_numbers_and_sharding():
    cases = check_sharded_optimizer(A.PlainOptimizer, world_sizes=(2,))
    assert "differ from rank 0's" in failed(cases, "SGD")
    assert "A plain Adam holds 2Ψ" in failed(cases, "state")


def test_an_optimizer_that_does_nothing_fails_every_case():
    cases = check_sharded_optimizer(A.DoNothingOptimizer, world_sizes=(2,))
    assert "differ from rank 0's" in failed(cases, "SGD")
    assert "keep the inner optimizer" in failed(cases, "state")
    assert not any(c.passed for c in cases)


def test_no_sharding_gets_the_numbers_right_and_still_fails_the_state_case():
    cases = check_sharded_optimizer(A.UnshardedOptimizer, world_sizes=(4,))
    assert passed(cases, "SGD") and passed(cases, "Adam: every rank")
    assert "Keep state for your 1/N slice only" in failed(cases, "state")


def test_a_summed_gradient_fails_with_sgd_even_where_adam_would_hide_it():
    cases = check_sharded_optimizer(A.SummedOptimizer, world_sizes=(2,))
    assert "you summed the gradients" in failed(cases, "SGD")
    assert passed(cases, "state")


def test_a_step_that_all_reduces_instead_of_reduce_scattering_fails_the_collectives_case():
    """The core build of §5 gives the layout; the step's one decision is the reduce-scatter."""
    cases = check_sharded_optimizer(A.AllReduceStepOptimizer, world_sizes=(2,))
    assert passed(cases, "SGD") and passed(cases, "Adam: every rank") and passed(cases, "state")
    assert "all-reduced" in failed(cases, "by hand") and "half an all-reduce" in \
        failed(cases, "by hand")


def test_a_missing_broadcast_fails_because_every_rank_starts_from_its_own_weights():
    cases = check_sharded_optimizer(A.NoBroadcastOptimizer, world_sizes=(2,))
    assert "Broadcast rank 0's parameters" in failed(cases, "SGD")


def test_an_answer_that_crashes_on_the_frozen_parameter_is_told_why():
    cases = check_sharded_optimizer(A.FrozenCrashOptimizer, world_sizes=(2,))
    assert "frozen parameter (requires_grad=False)" in failed(cases, "SGD")


def test_hidden_state_a_whole_optimizer_in_a_closure_with_a_decoy_slice_fails():
    cases = check_sharded_optimizer(A.ClosureOptimizer, world_sizes=(2,))
    assert passed(cases, "SGD") and passed(cases, "Adam: every rank")
    assert "wherever it is kept" in failed(cases, "state")
    assert "reduce-scattered 0" in failed(cases, "by hand")


def test_a_library_object_zero_redundancy_optimizer_in_a_closure_fails():
    cases = check_sharded_optimizer(A.LibraryInClosureOptimizer, world_sizes=(2,))
    detail = failed(cases, "state")
    assert "holds ZeroRedundancyOptimizer" in detail and "not with torch's library" in detail


def test_a_copied_oracle_that_never_communicates_fails():
    cases = check_sharded_optimizer(A.CopiedOracleOptimizer, world_sizes=(2,))
    assert not passed(cases, "SGD") and not passed(cases, "Adam: every rank")
    assert "a copied oracle" in failed(cases, "by hand")


def test_a_side_channel_through_the_store_fails_the_collectives_case():
    cases = check_sharded_optimizer(A.StoreOptimizer, world_sizes=(2,))
    assert passed(cases, "SGD") and passed(cases, "state")
    assert "the process group's store" in failed(cases, "by hand")


# ------------------------------------------------------------- exercise 2: ZeRO-3 layer
def test_a_summed_shard_gradient_fails_bit_exactness_naming_the_sum():
    cases = check_sharded_linear(A.SummedLinear, world_sizes=(2,))
    assert "you summed" in failed(cases, "bit-exact")
    assert passed(cases, "kept") and passed(cases, "traffic")


def test_keeping_the_gathered_weight_fails_memory_and_traffic():
    cases = check_sharded_linear(A.KeepsFullLinear, world_sizes=(2,))
    assert "free the gathered weight" in failed(cases, "kept")
    assert "two ring halves, not three" in failed(cases, "traffic")


def test_calling_the_library_collectives_fails_the_hand_written_case():
    cases = check_sharded_linear(A.LibraryLinear, world_sizes=(2,))
    assert "a library collective" in failed(cases, "traffic")
    assert passed(cases, "kept")


def test_a_missing_broadcast_fails_the_layer_in_forward():
    cases = check_sharded_linear(A.NoBroadcastLinear, world_sizes=(4,))
    assert "broadcast it before sharding" in failed(cases, "bit-exact")


def test_an_unsharded_layer_fails_every_case():
    cases = check_sharded_linear(A.UnshardedLinear, world_sizes=(2,))
    assert "a 1/2 shard" in failed(cases, "kept")
    assert not any(c.passed for c in cases)


def test_hidden_state_the_full_weight_kept_in_a_closure_fails_the_kept_case():
    cases = check_sharded_linear(A.ClosureKeepsLinear, world_sizes=(2,))
    assert passed(cases, "bit-exact") and passed(cases, "traffic")
    assert "wherever it is kept" in failed(cases, "kept")


def test_a_library_object_dtensor_with_its_mesh_in_a_closure_fails():
    cases = check_sharded_linear(A.DTensorLinear, world_sizes=(2,))
    assert "not with torch's library" in failed(cases, "kept")


def test_a_copied_oracle_with_decoy_sends_fails():
    cases = check_sharded_linear(A.CopiedOracleLinear, world_sizes=(2,))
    assert "copied result (the checker's oracle) cannot match" in failed(cases, "bit-exact")
    assert "decoys" in failed(cases, "traffic")


def test_a_side_channel_a_helper_thread_or_the_store_fails_the_traffic_case():
    cases = check_sharded_linear(A.HelperThreadLinear, world_sizes=(2,))
    assert passed(cases, "bit-exact")          # the helper thread's collectives are counted
    assert "a library collective" in failed(cases, "traffic")
    cases = check_sharded_linear(A.StoreLinear, world_sizes=(2,))
    assert passed(cases, "bit-exact")
    detail = failed(cases, "traffic")
    assert "decoys" in detail and "the process group's store" in detail


# ------------------------------------------------------------- exercise 3: Megatron MLP
def test_the_library_all_reduce_as_g_fails_numbers_and_the_count():
    cases = check_parallel_mlp(A.LibraryAllReduceMLP, world_sizes=(2,))
    assert "torch.distributed.nn.functional.all_reduce does that" in failed(cases, "output")
    assert "['all_reduce', 'all_reduce']" in failed(cases, "hand-written")


def test_forgetting_f_leaves_only_this_ranks_part_of_the_input_gradient():
    cases = check_parallel_mlp(A.NoFMLP, world_sizes=(2,))
    assert "only this rank's part" in failed(cases, "output")
    assert "no collective" in failed(cases, "hand-written")


def test_adding_the_row_parallel_bias_on_every_rank_fails_with_the_fix():
    cases = check_parallel_mlp(A.BiasEachRankMLP, world_sizes=(2,))
    assert "add it once, after the all-reduce" in failed(cases, "output")


def test_a_replicated_mlp_fails_the_split_case():
    cases = check_parallel_mlp(A.ReplicatedMLP, world_sizes=(2,))
    assert "expected (4, 6)" in failed(cases, "split")
    assert not any(c.passed for c in cases)


def test_parallelize_module_fails_the_hand_written_case():
    cases = check_parallel_mlp(A.LibraryTPMLP, world_sizes=(2,))
    assert "parallelize_module" in failed(cases, "hand-written")


class LabMegatron(lk.sharding.tensor_parallel.MegatronMLP):
    """The lab's own Megatron MLP (§7's reference), under the exercise's name."""


def test_the_lab_s_own_megatron_mlp_fails_every_case_naming_it():
    """It is right, split and hand-written: every case passed before the checker counted the
    lab's own implementations (labkit.grading.references)."""
    cases = check_parallel_mlp(LabMegatron, world_sizes=(2,))
    assert not any(c.passed for c in cases)
    assert all("lk's sharding.tensor_parallel.ColumnParallelLinear.forward" in c.detail
               for c in cases), cases


def test_the_lab_s_hand_zero_is_forbidden_to_the_zero_exercises_and_the_ring_halves_are_not():
    from labkit.sharding.check.jobs import LAB
    from labkit.grading.references import references_used
    assert lk.sharding.zero.HandZero.step.__qualname__ == "HandZero.step"
    with references_used(*LAB["linear_job"]) as used:
        try:
            lk.sharding.zero.HandZero.step(None)        # counted on entry, then fails
        except Exception:
            pass
        try:
            lk.sharding.ring_all_gather(None)            # §3's halves: the solution's tools
        except Exception:
            pass
    assert used == ["labkit.sharding.zero.HandZero.step"]


def test_hidden_state_the_whole_mlp_kept_in_a_closure_fails_the_split_case():
    cases = check_parallel_mlp(A.ClosureFullMLP, world_sizes=(2,))
    assert passed(cases, "input gradient") and passed(cases, "hand-written")
    assert "wherever it is kept" in failed(cases, "split")


def test_a_library_object_parallelize_module_in_a_closure_fails():
    cases = check_parallel_mlp(A.LibraryInClosureMLP, world_sizes=(2,))
    assert "not with parallelize_module" in failed(cases, "hand-written")


def test_a_copied_oracle_fails_numbers_and_the_payload():
    cases = check_parallel_mlp(A.CopiedOracleMLP, world_sizes=(2,))
    assert "copied result (the checker's oracle) cannot match" in failed(cases, "output")
    assert "not this rank's own" in failed(cases, "hand-written")


def test_a_side_channel_through_the_store_fails_the_count():
    cases = check_parallel_mlp(A.StoreMLP, world_sizes=(2,))
    assert passed(cases, "input gradient")
    assert "the process group's store" in failed(cases, "hand-written")


def test_a_computation_not_split_whole_mlp_with_the_right_payload_size_fails():
    cases = check_parallel_mlp(A.WholeMLP, world_sizes=(2,))
    assert passed(cases, "input gradient")
    assert "not tensor-parallel" in failed(cases, "hand-written")
    assert "not tensor-parallel" in failed(cases, "split")


# ------------------------------------------------------------- stubs, deadlocks, the grader
def test_stubs_report_not_done_through_lk_exercise():
    class Stub:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("write your code here")
    for qid in ("06.sharded_optimizer", "06.sharded_linear", "06.parallel_mlp"):
        assert lk.exercise.evaluate(qid, Stub).status == "not done"


class RankZeroWaits(A.ParallelMLP):
    """Wrong: rank 0 waits for a message rank 1 never sends."""

    def forward(self, x):
        import torch
        import torch.distributed as dist
        if dist.get_rank() == 0:
            dist.recv(torch.empty(1), src=1)
        return super().forward(x)


class RankZeroExtraAllReduce(A.ParallelMLP):
    """Wrong: rank 0 issues one all-reduce more, of another size than rank 1's next one."""

    def forward(self, x):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            dist.all_reduce(x.detach().clone())
        return super().forward(x)


@pytest.mark.timeout(60)   # in seconds: the checker's short collective timeouts, not pytest's
def test_a_deadlocked_answer_fails_in_seconds_and_leaves_no_rank():
    cases = check_parallel_mlp(RankZeroWaits, world_sizes=(2,))
    assert "a deadlock" in cases[0].detail and not any(c.passed for c in cases)
    assert_no_ranks_left()


def test_a_mismatched_collective_that_aborts_a_rank_fails_as_unverifiable():
    cases = check_parallel_mlp(RankZeroExtraAllReduce, world_sizes=(2,))
    assert "SIGABRT" in cases[0].detail and "cannot be verified" in cases[0].detail
    assert not any(c.passed for c in cases)
    assert_no_ranks_left()


def test_partial_credit_counts_the_cases_that_pass():
    score = lk.exercise.evaluate("06.sharded_linear", A.LibraryLinear)
    assert score.status == "partial" and 0 < score.points < score.max_points


def test_no_rank_outlives_the_checks():
    lk.shutdown()
    assert_no_ranks_left()


@pytest.mark.parametrize("setup", ["SGD with momentum", "Adam"])
def test_a_right_answer_s_float_noise_stays_within_the_tolerance(setup):
    """The ZeRO-1 checker compares with one process within ATOL/RTOL, and a right answer's
    gradients differ from one process's by fp32 summation-order noise (~1e-8). Adam scales
    each element's step to about lr whatever the gradient's size, so noise on an element whose
    gradient nearly cancels became a step error over ATOL (one right answer in a few hundred
    gradings failed with eps 1e-8). For every gradient size, three steps on a gradient and on
    the same gradient with that noise must stay well within the tolerance."""
    import torch

    from labkit.sharding.check.jobs import OPT_SETUPS
    from labkit.sharding.check import ATOL

    inner, defaults = OPT_SETUPS[setup]
    sizes = torch.logspace(-10, 0, 201)
    worst = 0.0
    for sign in (1.0, -1.0):
        runs = []
        for noise in (0.0, 1e-8):
            p = torch.nn.Parameter(torch.zeros(sizes.numel()))
            opt = inner([p], **defaults)
            for step in range(3):
                p.grad = sign * sizes * (1 + 0.1 * step) + noise
                opt.step()
            runs.append(p.detach().clone())
        worst = max(worst, float((runs[0] - runs[1]).abs().max()))
    assert worst < ATOL / 4, f"{setup}: 1e-8 of gradient noise moved a parameter by {worst:.3g}"
