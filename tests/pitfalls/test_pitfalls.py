"""Every pitfall of notebook 04 really happens on real gloo ranks, and its verdict is asserted.

Each failing scenario must surface within 10 s of the job starting on the ranks (the
wall time of the ranks that failed) and leave no process behind; its fix must work.
Training scenarios share one timeout so consecutive jobs reuse warm ranks.
"""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import assert_no_ranks_left, needs_gpus

import labkit as lk
from labkit.diagnosis import compare_fingerprints
from labkit.pitfalls import check

P = lk.pitfalls
pytestmark = pytest.mark.timeout(120)


def failed(out, kind, culprits=None, collective=None):
    """The scenario failed the way it should and cleaned up after itself (fast: the module's
    pytest timeout bounds every scenario; each one's own limits are a few seconds)."""
    v = out.verdict
    assert v.kind == kind, str(out)
    if culprits is not None:
        assert v.culprits == culprits, str(out)
    if collective is not None:
        assert v.collective == collective, str(out)
    assert_no_ranks_left()
    return v


def works(out):
    assert out.ok and out.verdict.ok, str(out)
    return out


# ------------------------------------------------------------ collective failures
def test_late_rank_times_out_and_its_stack_shows_where_it_was():
    v = failed(P.late_rank(), "missing_rank", [1], "all_reduce")
    assert "sleep" in v.where[1] and v.ranks[0].state == "timed out"
    works(P.late_rank(late_s=0.3))   # late, but within the timeout: fine


def test_skipped_collective():
    v = failed(P.skipped_collective(), "missing_rank", [1], "all_reduce")
    assert "returned normally" in v.cause
    assert works(P.skipped_collective(fixed=True)).result.values == [[3.0] * 3] * 2


def test_monitored_barrier_names_missing_ranks():
    out = P.missing_ranks()
    failed(out, "missing_rank", [2, 3], "monitored_barrier")
    assert "Ranks 2, 3 failed to pass monitoredBarrier" in out.result[0].error
    works(P.missing_ranks(fixed=True))


def test_mismatched_collectives_time_out_then_detail_names_them_at_once():
    failed(P.mismatched(), "mismatch", [0, 1], "all_reduce vs broadcast")
    out = P.mismatched(detail=True)
    v = failed(out, "mismatch", [0, 1], "all_reduce vs broadcast")
    assert v.seq is not None
    errors = [r.error or "" for r in out.result.ranks]       # detected, not timed out:
    assert any("Detected mismatch between collectives" in e for e in errors), errors
    assert not any("Timed out" in e for e in errors), errors
    works(P.mismatched(fixed=True))


def test_collective_under_if():
    failed(P.collective_under_if(), "mismatch", [0, 1], "all_reduce vs barrier")
    failed(P.collective_under_if(detail=True), "mismatch", [0, 1], "all_reduce vs barrier")
    assert works(P.collective_under_if(fixed=True)).result.values == [1.5, 1.5]


def test_extra_all_reduce_gives_wrong_numbers_then_a_hang():
    out = P.extra_all_reduce()
    failed(out, "missing_rank", [1], "all_reduce")
    r1 = out.result[1].value
    assert r1["grad"] != r1["expected"]          # rank 1 returned, silently wrong
    v = works(P.extra_all_reduce(fixed=True)).result.values[1]
    assert v["grad"] == v["expected"]


def test_swapped_order_is_silent_even_under_detail():
    out = P.swapped_order()
    assert out.result.ok and out.verdict.kind == "replicas_diverged"
    assert out.verdict.culprits == [1]
    detail = P.swapped_order(detail=True)         # DETAIL checks shapes, not meaning
    assert detail.result.ok and detail.verdict.kind == "replicas_diverged"
    works(P.swapped_order(fixed=True))


@pytest.mark.parametrize("dtype", [False, True])
def test_size_or_dtype_mismatch_aborts_a_rank(dtype):
    out = P.size_mismatch(dtype=dtype)
    v = failed(out, "size_mismatch", collective="all_reduce")
    aborted = [r for r in out.result.ranks if r.status == "signaled"]
    assert [r.signal for r in aborted] == ["SIGABRT"] and v.culprits == [aborted[0].rank]
    assert "Received data size doesn't match" in aborted[0].stderr


def test_size_mismatch_under_detail_is_a_python_error():
    out = P.size_mismatch(detail=True)
    v = failed(out, "size_mismatch", [0, 1], "all_reduce")
    assert "[4]" in v.headline and "[5]" in v.headline
    assert not any(r.status == "signaled" for r in out.result.ranks)
    works(P.size_mismatch(fixed=True))


@pytest.mark.parametrize("how,kind", [("raise", "error"), ("exit", "crash"), ("kill", "crash")])
def test_a_crashed_rank_and_what_the_survivors_see(how, kind):
    v = failed(P.crashed_rank(how=how), kind, [1])
    assert {f.rank for f in v.ranks if f.state == "echo"} == {0, 2}


def test_flight_recorder_names_the_rank_and_the_collective_number():
    out = P.flight_recorder()
    v = out.verdict
    assert (v.kind, v.culprits, v.collective, v.seq) == ("missing_rank", [1], "all_reduce", 3)
    assert out.result.ok  # each rank caught its timeout and returned its record
    assert out.result[0].value.error and "Timed out" in out.result[0].value.error


def test_mystery_hang_is_read_from_the_stacks():
    res = P.mystery()
    assert [r.status for r in res.ranks] == ["hung"] * 4
    assert check.mystery_stuck_rank(res) == 2 and check.mystery_collective(res) == "broadcast"
    assert "_load_shard" in res[2].where and "broadcast" in res[0].where
    assert_no_ranks_left()


def test_show_prints_a_scenarios_code(capsys):
    src = P.show("skipped_collective")
    assert "# BUG" in src and "dist.all_reduce" in capsys.readouterr().out
    with pytest.raises(KeyError, match="late_rank"):
        P.show("nope")


# ------------------------------------------------------------ training divergence
def test_training_without_sync_diverges_and_ddp_matches_the_oracle():
    v = P.unsynced_training().verdict
    assert v.kind == "replicas_diverged" and v.headline.startswith("4 of 4 parameters")
    out = works(P.unsynced_training(fixed=True))
    assert compare_fingerprints([P.oracle_fingerprint(), out.result.values[0]], 1e-5).ok


def test_batchnorm_stats_differ_and_all_reducing_them_fixes_it():
    v = P.batchnorm_stats().verdict
    assert v.kind == "replicas_diverged" and "only buffers differ" in v.cause
    assert "0 of 6 parameters" in v.headline
    works(P.batchnorm_stats(sync=True))


@pytest.mark.parametrize("mode,calls,kind", [("sync_every", 6, "ok"), ("no_sync", 2, "ok"),
                                             ("no_sync_always", 0, "replicas_diverged")])
def test_gradient_accumulation(mode, calls, kind):
    out = P.accumulation(mode=mode)           # 2 steps x 3 micro-batches, one bucket
    assert out.result.ok and out.verdict.kind == kind
    assert [v["allreduces"] for v in out.result.values] == [calls, calls]


def test_accumulation_with_no_sync_equals_syncing_every_micro_batch():
    a = P.accumulation(mode="sync_every").result.values[0]["fingerprint"]
    b = P.accumulation(mode="no_sync").result.values[0]["fingerprint"]
    assert compare_fingerprints([a, b], 1e-6).ok


def test_unused_parameters_fail_on_iteration_two_until_find_unused():
    out = P.unused_parameters()
    v = failed(out, "unused_parameters", [0, 1])
    assert "4 5" in v.headline                # aux.weight, aux.bias: parameter indices 4 and 5
    works(P.unused_parameters(fixed=True))


def test_uneven_inputs_hang_in_backward_until_join():
    v = failed(P.uneven_inputs(), "missing_rank", [0])
    assert v.collective.startswith("backward") and "Join" in v.fix
    assert works(P.uneven_inputs(join=True)).result.values == [2, 3]


@pytest.mark.parametrize("mode,kind,fix", [("no_sampler", "data_sharding", "DistributedSampler"),
                                           ("no_set_epoch", "data_sharding", "set_epoch"),
                                           ("fixed", "ok", "")])
def test_sampler_shards(mode, kind, fix):
    out = P.sampler_shards(mode=mode)
    assert out.verdict.kind == kind and fix in out.verdict.fix
    logs = out.result.values
    if mode == "fixed":
        assert sorted(logs[0].epochs[0] + logs[1].epochs[0]) == list(range(16))


def _bn_layer_job(rank, world_size, x):
    from labkit.pitfalls.divergence import AllReduceBatchNorm1d

    torch.manual_seed(0)
    bn = AllReduceBatchNorm1d(3)
    mine = x.tensor_split(world_size)[rank].clone().requires_grad_(True)
    out = bn(mine)
    (out * torch.arange(1.0, 4.0)).sum().backward()
    return out.detach(), mine.grad, bn.running_mean, bn.running_var


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_batchnorm_equals_batchnorm_on_the_whole_batch(world_size):
    x = torch.randn(12, 3) * 3 + 1
    got = lk.run(_bn_layer_job, world_size, args=(x,), timeout=5, echo=False).values
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    xf = x.clone().requires_grad_(True)
    out = bn(xf)
    (out * torch.arange(1.0, 4.0)).sum().backward()
    torch.testing.assert_close(torch.cat([g[0] for g in got]), out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g[1] for g in got]), xf.grad, atol=1e-5, rtol=1e-5)
    for g in got:
        torch.testing.assert_close(g[2], bn.running_mean)
        torch.testing.assert_close(g[3], bn.running_var)


# ------------------------------------------------------------ the repair exercise
def _synced_training(rank, world_size, steps=3, average=True):
    import torch.distributed as dist
    from torch import nn
    from labkit.pitfalls.divergence import sgd_step, shard_batch, tiny_model
    from labkit.diagnosis import fingerprint

    model = tiny_model()
    for step in range(steps):
        x, y = shard_batch(rank, world_size, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if average:                      # the wrong answer sums and never divides
                p.grad /= world_size
        sgd_step(model, 0.1)
    return fingerprint(model)


_averaged = _synced_training
_summed_not_averaged = functools.partial(_synced_training, average=False)


def test_replica_training_checker_against_right_and_wrong_answers():
    assert all(c.passed for c in check.check_replica_training(_averaged))
    broken = check.check_replica_training(P.broken_training)
    assert not any(c.passed for c in broken) and "disagree" in broken[0].detail
    summed = check.check_replica_training(_summed_not_averaged)
    assert not any(c.passed for c in summed) and "average" in summed[0].detail


@pytest.mark.gpu
@needs_gpus(2)
def test_nccl_watchdog_fires_and_is_diagnosed():
    out = P.nccl_watchdog()
    v = out.verdict
    assert (v.kind, v.culprits, v.collective) == ("missing_rank", [1], "all_reduce"), str(out)
    assert "NCCL INFO" in out.result[0].stderr
    assert_no_ranks_left()
