"""Hand-written DDP (labkit.ddp) against torch DDP and a single-process oracle on 2-4 ranks."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

import labkit as lk
from labkit.ddp import assign_buckets
from labkit.ddp.check import oracle_history, shard_batches

from conftest import assert_no_ranks_left

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ pure logic
def test_assign_buckets_closes_a_bucket_once_it_reaches_the_cap():
    mb = 2**20
    assert assign_buckets([mb // 2, mb // 2, mb // 2], 1.0) == [[0, 1], [2]]
    assert assign_buckets([mb, 1, 1], 1.0) == [[0], [1, 2]]
    assert assign_buckets([8, 8, 8], 0) == [[0], [1], [2]]
    assert assign_buckets([8, 8, 8], 25) == [[0, 1, 2]]
    assert assign_buckets([], 1.0) == []


def test_assign_buckets_splits_on_dtype_change_and_rejects_negative_caps():
    assert assign_buckets([4, 4, 4], 25, keys=["f32", "f16", "f16"]) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        assign_buckets([4], -1)


# ------------------------------------------------------------- ranks: training
def _train_all_variants(rank, world_size, steps, lr, seed):
    """Train torch DDP and every hand-written variant from rank-dependent inits; log each step."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.ddp import BucketedDDP, NaiveDDP
    from labkit.ddp.check import TiedTiny, shard_batches
    from labkit.ddp.check.oracle import state_of

    def reference_init():
        torch.manual_seed(seed)
        return TiedTiny().state_dict()

    variants = {
        "torch": lambda m: DDP(m),
        "naive": NaiveDDP,
        "overlap": lambda m: BucketedDDP(m, bucket_cap_mb=0),
        "buckets": lambda m: BucketedDDP(m, bucket_cap_mb=0.0001),   # ~100 bytes: 2 buckets
        "one_bucket": lambda m: BucketedDDP(m, bucket_cap_mb=25),
    }
    out = {}
    for name, wrap in variants.items():
        torch.manual_seed(rank)                 # different on every rank: broadcast must fix it
        model = TiedTiny()
        if rank == 0:
            model.load_state_dict(reference_init())
        ddp = wrap(model)
        history = []
        for shards in shard_batches(world_size, steps, seed=seed):
            x, y = shards[rank]
            model.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            if name != "torch":
                ddp.finish_gradient_synchronization()
            grads = {n: None if p.grad is None else p.grad.clone()
                     for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=lr)
            history.append({"grads": grads, "params": state_of(model)})
        out[name] = {"history": history, "calls": getattr(ddp, "allreduce_calls", None),
                     "buckets": getattr(ddp, "buckets", None)}
    return out


@pytest.mark.slow   # torch DDP imports torch._dynamo in every fresh rank: seconds per world size
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_variant_matches_torch_ddp_and_the_oracle_on_every_rank_every_step(world_size):
    steps, lr, seed = 3, 0.5, 7
    res = lk.run(_train_all_variants, world_size, args=(steps, lr, seed), timeout=20, echo=False)
    oracle = oracle_history(world_size, steps, lr, seed)
    for name in ("torch", "naive", "overlap", "buckets", "one_bucket"):
        for rank in range(world_size):
            for step, want in enumerate(oracle):
                got = res.values[rank][name]["history"][step]
                for key in ("grads", "params"):
                    for pname, w in want[key].items():
                        g = got[key][pname]
                        if w is None:
                            assert g is None, (name, rank, step, pname)
                            continue
                        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), \
                            f"{name} rank {rank} step {step} {key} {pname}: " \
                            f"{(g - w).abs().max().item():.3g}"
                        # and bit-identical to rank 0: replicas never drift
                        assert torch.equal(g, res.values[0][name]["history"][step][key][pname])
    # frozen parameter stays untouched; tied weight is one parameter
    frozen0 = oracle[0]["params"]["frozen.weight"]
    assert torch.equal(oracle[-1]["params"]["frozen.weight"], frozen0)
    assert "head.weight" not in oracle[0]["params"]
    # bucket bookkeeping: one all_reduce per bucket per step
    buckets = res.values[0]["buckets"]["buckets"]
    assert len(buckets) >= 2, buckets
    assert res.values[0]["buckets"]["calls"] == steps * len(buckets)
    assert res.values[0]["overlap"]["calls"] == steps * 3          # 3 trainable tensors
    assert res.values[0]["one_bucket"]["calls"] == steps
    assert res.values[0]["naive"]["calls"] == steps * 3


def test_oracle_is_not_the_global_mean_when_the_last_batch_is_uneven():
    # The uneven last step is a real trap: averaging per-rank means != mean over all examples.
    import torch.nn.functional as F

    from labkit.ddp.check import TiedTiny

    shards = shard_batches(4, steps=3, seed=7)[-1]
    assert [len(y) for _, y in shards] == [3, 2, 3, 2]
    torch.manual_seed(7)
    model = TiedTiny()
    per_rank = sum(F.cross_entropy(model(x), y) for x, y in shards) / 4
    x = torch.cat([x for x, _ in shards])
    y = torch.cat([y for _, y in shards])
    assert abs(per_rank.item() - F.cross_entropy(model(x), y).item()) > 1e-4


def _overlap_and_accumulation(rank, world_size):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from labkit.ddp import BucketedDDP
    from labkit.common.timeline import Timeline, now

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    tl = Timeline(rank)
    ddp = BucketedDDP(layers, bucket_cap_mb=0.015, timeline=tl)   # 16.6 KB/layer > cap: 6 buckets
    x = torch.randn(8, 64) + rank
    loss = F.mse_loss(ddp(x), torch.zeros(8, 64))
    loss.backward()
    backward_end = now()
    ddp.finish_gradient_synchronization()
    comm = [s for s in tl.spans if s["kind"] == "all_reduce"]
    launched_during_backward = sum(s["start"] < backward_end for s in comm)

    # gradient accumulation: 4 micro-batches, 3 under no_sync -> one round of all-reduces
    ddp.module.zero_grad()
    calls_before = ddp.allreduce_calls
    for i in range(4):
        xb = torch.randn(2, 64, generator=torch.Generator().manual_seed(10 * rank + i))
        if i < 3:
            with ddp.no_sync():
                F.mse_loss(ddp(xb), torch.zeros(2, 64)).backward()
        else:
            F.mse_loss(ddp(xb), torch.zeros(2, 64)).backward()
            ddp.finish_gradient_synchronization()
    accumulated = [p.grad.clone() for p in layers.parameters()]
    return {"buckets": len(ddp.buckets), "comm": len(comm), "during": launched_during_backward,
            "accum_calls": ddp.allreduce_calls - calls_before, "accumulated": accumulated}


def test_bucketed_ddp_overlaps_backward_and_no_sync_accumulates_without_communicating():
    res = lk.run(_overlap_and_accumulation, 2, timeout=20, echo=False)
    r0 = res.values[0]
    assert r0["buckets"] == 6 and r0["comm"] == 6
    assert r0["during"] >= 1, "no all_reduce started before backward returned: no overlap"
    assert r0["accum_calls"] == r0["buckets"]          # 1 round for 4 micro-batches, not 4
    for a, b in zip(res.values[0]["accumulated"], res.values[1]["accumulated"]):
        assert torch.equal(a, b)
    # the accumulated gradient is the average over ranks of the sum over micro-batches
    from torch import nn
    import torch.nn.functional as F
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for rank in range(2):
        for i in range(4):
            xb = torch.randn(2, 64, generator=torch.Generator().manual_seed(10 * rank + i))
            (F.mse_loss(layers(xb), torch.zeros(2, 64)) / 2).backward()
    for want, got in zip(layers.parameters(), r0["accumulated"]):
        assert torch.allclose(got, want.grad, atol=1e-6, rtol=1e-4)


def _unused_parameter(rank, world_size):
    import torch
    from torch import nn

    from labkit.ddp import BucketedDDP

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3), "never": nn.Linear(3, 3)})
    ddp = BucketedDDP(model, bucket_cap_mb=0)
    x = torch.ones(1, 3) * (rank + 1)
    out = model["a"](x) if rank == 0 else model["b"](x)   # each rank leaves another layer unused
    out.sum().backward()
    ddp.finish_gradient_synchronization()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_bucketed_ddp_survives_parameters_unused_on_some_ranks():
    res = lk.run(_unused_parameter, 2, timeout=10, echo=False)
    g0, g1 = res.values
    for name in g0:
        assert (g0[name] is None and g1[name] is None) or torch.equal(g0[name], g1[name]), name
    # rank 0 used only "a": the average is half of rank 0's local gradient (ones * 1 / 2)
    assert torch.allclose(g0["a.weight"], torch.full((3, 3), 0.5))
    assert torch.allclose(g0["b.weight"], torch.full((3, 3), 1.0))   # 2 / 2 from rank 1
    assert g0["never.weight"] is None and g0["never.bias"] is None   # no rank used it


def test_no_rank_outlives_the_tests():
    lk.shutdown()
    assert_no_ranks_left()


def test_outside_a_rank_the_error_says_where_to_run_it():
    from torch import nn

    from labkit.ddp import BucketedDDP, NaiveDDP, average_gradients
    for make in (lambda: NaiveDDP(nn.Linear(2, 2)), lambda: BucketedDDP(nn.Linear(2, 2)),
                 lambda: average_gradients(nn.Linear(2, 2))):
        with pytest.raises(RuntimeError, match="inside a function you run with\\s+lk.run"):
            make()
