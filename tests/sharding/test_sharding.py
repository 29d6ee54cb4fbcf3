"""labkit.sharding (notebook 06): pure logic first, then real gloo jobs against one process."""
from __future__ import annotations

import sys

import cloudpickle
import matplotlib
import pytest
import torch

import labkit as lk
from labkit.sharding import calculator as C
from labkit.sharding import memory
from labkit.sharding.bench import table
from labkit.sharding.optim import SGD, Adam
from labkit.sharding.zero import FlatLayout, HandZero

from conftest import assert_no_ranks_left

matplotlib.use("Agg")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------ pure logic
@pytest.mark.parametrize("ours, theirs, kwargs", [
    (Adam, torch.optim.Adam, {"lr": 1e-2}),
    (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (SGD, torch.optim.SGD, {"lr": 0.1}),
])
def test_the_written_out_optimizers_match_torch_optim_bit_for_bit(ours, theirs, kwargs):
    torch.manual_seed(0)
    a = torch.randn(37, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    mine, ref = ours([a], **kwargs), theirs([b], **kwargs)
    for _ in range(4):
        g = torch.randn(37)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    assert torch.equal(a, b)


def test_an_optimizer_without_parameters_says_what_to_pass():
    with pytest.raises(ValueError, match="empty parameter list"):
        Adam([])


def test_flat_layout_pads_the_last_shard_and_round_trips():
    w, b = torch.arange(15.0).view(5, 3), torch.arange(5.0)
    lay = FlatLayout([w.shape, b.shape], world_size=3, rank=2)
    flat = lay.flatten([w, b])
    assert (lay.numel, lay.shard_numel, lay.padded) == (20, 7, 21)
    assert flat[20] == 0 and torch.equal(lay.shard(flat), flat[14:21])
    w2, b2 = lay.views(flat)
    assert torch.equal(w2, w) and torch.equal(b2, b) and w2.data_ptr() == flat.data_ptr()


def test_storage_bytes_counts_each_storage_once_and_views_in_full():
    base = torch.zeros(100)
    view = base[10:20]
    other = torch.zeros(5)
    assert memory.storage_bytes([base, view, other, None]) == 4 * 105
    assert memory.storage_bytes([view]) == 400           # a small view holds its whole storage
    assert memory.storage_bytes([base, other], exclude=[view]) == 20


def test_reachable_tensors_finds_state_whatever_it_is_called():
    class Hidden:
        def __init__(self):
            self.nested = {"deep": [(torch.ones(3),)]}
            self.param = torch.nn.Parameter(torch.ones(2))
            self.param.grad = torch.ones(2)
            self.name = "x"
    found = memory.reachable_tensors(Hidden())
    assert sorted(t.numel() for t in found) == [2, 2, 3]


def test_hand_zero_rejects_a_stage_it_does_not_have():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        HandZero(torch.nn.Linear(2, 2), stage=4)


def test_the_formulas_are_the_zero_papers():
    psi, n = 1000, 4
    assert C.memory_per_rank(psi, n, "DDP")["total"] == 20 * psi
    assert C.memory_per_rank(psi, n, "DDP", buckets=False)["total"] == 16 * psi
    assert C.memory_per_rank(psi, n, "ZeRO-1")["total"] == 8 * psi + 8 * psi / n
    assert C.memory_per_rank(psi, n, "ZeRO-2")["total"] == 4 * psi + 12 * psi / n
    assert C.memory_per_rank(psi, n, "ZeRO-3", "mixed")["total"] == 16 * psi / n
    assert [C.traffic_per_step(psi, n, s)["multiple_of_psi"] for s in C.SETUPS] == [2, 2, 2, 3, 3]
    assert C.traffic_per_step(psi, n, "ZeRO-3")["ring_sent"] == 3 * 4 * psi * 3 / 4
    with pytest.raises(ValueError, match="setup must be one of"):
        C.memory_per_rank(psi, n, "ZeRO-4")


def test_gpt2_sizes_and_the_70b_plan():
    assert C.MODELS["GPT-2 small"] == 124_439_808 and C.MODELS["GPT-2 XL"] == 1_557_611_200
    fits = {r["setup"]: r["fits"] for r in C.plan(C.MODELS["70B"], 64, gpu_gib=80)}
    assert fits == {"DDP": False, "ZeRO-1": False, "ZeRO-2": False, "ZeRO-3": True}
    assert "PREDICTION" in C.plan_table()


def test_the_evaluation_scores_an_empty_notebook_zero(capsys):
    assert lk.quiz.tally("06_sharding", namespace={}) == 0
    out = capsys.readouterr().out
    assert "06.sharded_linear" in out and "0 / 22" in out


def test_ddp_memory_names_the_optimizers_it_knows():
    with pytest.raises(ValueError, match="'adam' or 'sgd'"):
        lk.sharding.ddp_memory(0, 1, optimizer="adagrad")


def test_the_benchmark_table_puts_each_step_time_over_fsdp2s():
    row = lambda setup, ms: {"world_size": 2, "setup": setup, "impl": setup, "psi": 100,  # noqa: E731
                             "ring_sent": 400.0, "max_diff": 0.0, "step_ms": ms,
                             "memory": {"params": 400, "grads": 400, "optimizer": 800,
                                        "buckets": 0, "total": 1600}}
    text = table([row("ZeRO-3", 30.0), row("FSDP2", 20.0)])
    assert "| 30.0 | 1.50 |" in text and "| 20.0 | 1.00 |" in text and "| 2.00 |" in text


def test_the_pictures_draw_from_measurements():
    from labkit.sharding import pictures
    mem = {"params": 4, "grads": 4, "optimizer": 8, "buckets": 4}
    figs = [pictures.zero_diagram(2),
            pictures.memory_bars([{"label": "DDP", "memory": mem, "formula": 20}]),
            pictures.traffic_bars([{"label": "DDP", "ring_sent": 8.0}], psi=2, world_size=2),
            pictures.step_timelines([[{"rank": 0, "lane": "comm", "kind": "all_gather",
                                       "label": "L0", "start": 0.0, "end": 1.0}]],
                                    [[{"rank": 0, "lane": "compute", "kind": "forward",
                                       "label": "", "start": 0.0, "end": 1.0}]])]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    import matplotlib.pyplot as plt
    plt.close("all")


# ------------------------------------------------------------------ real ranks
def _halves(rank, world_size, numel):
    import torch.distributed as dist
    from labkit.sharding import CommCounter, ring_all_gather, ring_reduce_scatter
    torch.manual_seed(rank)
    flat = torch.randn(numel)
    want = flat.clone()
    dist.all_reduce(want)
    with CommCounter() as comm:
        mine = ring_reduce_scatter(flat)
        full = ring_all_gather(mine)
    return (torch.allclose(mine, want.chunk(world_size)[rank], atol=1e-5),
            torch.allclose(full, want, atol=1e-5), comm.ring_sent())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_ring_halves_equal_the_library_and_send_n_minus_1_over_n(world_size):
    numel = 6 * world_size
    for rs_ok, ag_ok, sent in lk.run(_halves, world_size, args=(numel,), echo=False).values:
        assert rs_ok and ag_ok
        assert sent == 2 * (world_size - 1) / world_size * numel * 4


@pytest.mark.timeout(60)
def test_the_ring_halves_refuse_an_unpadded_tensor_with_the_fix():
    def job(rank, world_size):
        from labkit.sharding import ring_reduce_scatter
        ring_reduce_scatter(torch.ones(5))
    with pytest.raises(lk.RankError) as err:
        lk.run(job, 2, echo=False)
    assert "pad to a multiple of 2" in str(err.value.__cause__)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_setup_matches_one_process_with_the_formulas_memory_and_counted_traffic(world_size):
    names = lk.sharding.SETUP_NAMES if world_size == 2 else ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    runs = lk.run(lk.sharding.run_setups, world_size, args=(names,), timeout=60,
                  echo=False).values
    n = world_size
    for per_rank in runs:
        for row in per_rank:
            assert row["max_diff"] < 1e-5, row
    by = {r["setup"]: r for r in runs[0]}
    psi, unit = by["DDP"]["psi"], 4 * by["DDP"]["psi"] * (n - 1) / n
    expected = {"DDP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3, "ZeroRedundancyOptimizer": 3,
                "FSDP2": 3, "FSDP2 no reshard": 2}
    pad = 3 * 4 * n                        # at most n-1 padded elements per layer, 3 layers
    for name, row in by.items():
        assert abs(row["ring_sent"] - expected[name] * unit) <= expected[name] * pad, name
        setup = {"FSDP2": "ZeRO-3", "FSDP2 no reshard": "ZeRO-3"}.get(name, name)
        formula = C.memory_per_rank(psi, n, setup)
        if name != "ZeroRedundancyOptimizer":          # splits by whole parameter (claim test)
            assert abs(row["memory"]["total"] - formula["total"]) <= 4 * pad + 64, name
    assert by["ZeRO-3"]["memory"]["transient"] > 0 and by["ZeRO-2"]["memory"]["grads"] < \
        by["ZeRO-1"]["memory"]["grads"]


@pytest.mark.timeout(60)
def test_a_traced_fsdp_step_shows_every_layers_gathers_and_a_ddp_step_its_buckets():
    traces = lk.run(lambda r, w: [lk.sharding.traced_step(r, w, k) for k in ("FSDP2", "DDP")],
                    2, timeout=60, echo=False).values
    counts = lk.sharding.trace.collective_counts([t[0] for t in traces])
    assert counts == [{"all_gather": 6, "reduce_scatter": 3}] * 2
    ddp = lk.sharding.trace.collective_counts([t[1] for t in traces])
    assert ddp == [{"all_reduce": 3}] * 2     # no bucket-rebuild broadcasts in the traced step
    kinds = {s["kind"] for s in traces[0][0]}
    assert {"forward", "backward", "step", "all_gather", "reduce_scatter"} <= kinds


@pytest.mark.timeout(60)
def test_tensor_parallel_by_hand_and_by_torch_equal_one_process_on_2_and_4_ranks():
    for n in (2, 4):
        values = lk.run(lambda r, w: (lk.sharding.tp_by_hand(r, w), lk.sharding.tp_library(r, w)),
                        n, timeout=60, echo=False).values
        for hand, lib in values:
            for v in (hand, lib):
                assert max(v["out_diff"], v["x_grad_diff"], v["grad_diff"]) < 1e-5
                assert set(v["sends"]) == {"fc1 backward", "fc2 forward"}
            assert hand["holds"]["fc1"]["bytes"] * n == hand["full_bytes"]["fc1"]


@pytest.mark.timeout(60)
def test_the_2d_mesh_trains_like_one_process_and_splits_its_sends_by_dimension():
    values = lk.run(lk.sharding.mesh_2d, 4, timeout=60, echo=False).values
    assert max(v["max_diff"] for v in values) < 1e-5
    assert sorted((v["coords"]["dp"], v["coords"]["tp"]) for v in values) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    dims = {(row["kind"], row["mesh_dim"]) for row in values[0]["sends"]}
    assert dims == {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "tp")}
    with pytest.raises(lk.RankError, match="run it on 4 ranks"):
        lk.run(lk.sharding.mesh_2d, 2, echo=False)


def test_no_rank_outlives_the_sharding_jobs():
    lk.shutdown()
    assert_no_ranks_left()
