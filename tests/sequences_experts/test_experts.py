"""labkit.sequences_experts.experts: the one-process MoE (capacity, drop order, gates, the
load-balancing loss), the expert-parallel layer against it on real ranks (forward, backward,
bytes to the byte), the lab's own dispatch_combine, the imbalance job and the benchmark rows.

Rank jobs are shared: one job per world size runs every configuration (what is tested there is
the numbers each returns, not state hidden between them)."""
from __future__ import annotations

import math

import matplotlib
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.sequences_experts import experts as X
from labkit.sequences_experts.check import experts as check

matplotlib.use("Agg")


# ------------------------------------------------------------------ one process
def test_capacity_is_the_ceiling_of_the_formula_exactly_in_decimal():
    assert X.capacity(64, 8, 1, 1.25) == 10 and X.capacity(64, 8, 2, 1.25) == 20
    assert X.capacity(10, 1, 1, 1.1) == 11                  # 1.1 * 10 is 11.000000000000002
    assert X.capacity(6, 2, 1, 1.0) == 3 and X.capacity(7, 4, 2, None) == 14
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        X.capacity(8, 2, 1, 0)


def test_first_choices_are_served_before_second_choices_in_token_order():
    """Expert 0 is the first choice of tokens 2, 3 and the second choice of tokens 0, 1 (whose
    first choice is expert 1); capacity 2 per expert keeps the first choices."""
    logits = torch.tensor([[2.0, 3.0, 0.0], [2.0, 3.0, 0.0], [3.0, 0.0, 2.0], [3.0, 0.0, 2.0]])
    r = X.route(logits, k=2, capacity_factor=0.75)          # ceil(0.75 * 4 * 2 / 3) = 2
    assert r.capacity == 2
    assert r.experts.tolist() == [[1, 0], [1, 0], [0, 2], [0, 2]]
    assert r.keep.tolist() == [[True, False], [True, False], [True, True], [True, True]]
    assert r.routed == [4, 2, 2] and r.kept == [2, 2, 2] and r.dropped == 2
    assert r.dropped_tokens == 0                             # each kept its first choice
    assert torch.allclose(r.gates.sum(1), torch.ones(4))     # top-2 gates sum to 1


def test_top1_gate_is_the_router_probability_and_carries_its_gradient():
    moe = X.MoE(d_model=8, d_hidden=8, num_experts=4, k=1, capacity_factor=None)
    x = X.batch(0, 12, 8)
    y, r = moe(x)
    assert torch.allclose(r.gates[:, 0], r.probs.max(dim=1).values)
    y.sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_the_output_is_the_gated_sum_of_kept_experts_and_zero_for_dropped_tokens():
    moe = X.MoE(d_model=8, d_hidden=16, num_experts=4, k=2, capacity_factor=0.5)
    x = X.batch(1, 20, 8)
    with torch.no_grad():
        y, r = moe(x)
        assert r.dropped > 0
        for t in range(20):
            want = torch.zeros(8)
            for j in range(2):
                if r.keep[t, j]:
                    want += r.gates[t, j] * moe.experts[int(r.experts[t, j])](x[t:t + 1])[0]
            assert torch.allclose(y[t], want, atol=1e-6), t
            if not r.keep[t].any():
                assert bool((y[t] == 0).all())


def test_the_load_balancing_loss_is_1_when_uniform_and_e_when_all_on_one():
    E, T = 4, 8
    uniform = torch.full((T, E), 1.0 / E)
    first = torch.arange(T) % E                               # every expert first twice
    assert X.load_balancing_loss(uniform, first).item() == pytest.approx(1.0)
    sure = F.one_hot(torch.zeros(T, dtype=torch.long), E).float()
    assert X.load_balancing_loss(sure, torch.zeros(T, dtype=torch.long)).item() == \
        pytest.approx(E)


def test_route_refuses_k_other_than_1_or_2():
    with pytest.raises(ValueError, match="k must be 1"):
        X.route(torch.zeros(3, 4), k=3)


def test_skewed_sends_most_tokens_to_the_chosen_experts_and_leaves_the_original():
    moe = X.MoE(num_experts=4)
    x = X.batch(0, 256, 16)
    lop = X.skewed(moe, toward=[0, 1], by=3.0)
    with torch.no_grad():
        assert sum(lop.route(x).routed[:2]) > 0.9 * 256
        assert float(moe.logit_bias.abs().sum()) == 0.0


def test_expert_parallel_refuses_experts_not_divisible_by_ranks_naming_the_parameter():
    with pytest.raises(ValueError, match=r"num_experts=6 is not a multiple of world_size=4"):
        X.ExpertParallelMoE(X.MoE(num_experts=6), rank=0, world_size=4)
    ep = X.ExpertParallelMoE(X.MoE(num_experts=6), rank=1, world_size=3)
    assert ep.owned == [2, 3] and len(ep.local) == 2


def test_a2a_bytes_counts_counts_rows_and_framing():
    f = X.a2a_bytes([10, 6, 4], [10, 3, 0], rank=0, d_model=8, experts_per_rank=2)
    assert f["payload"] == 8 * 2 * 2 + 32 * (10 + 3) and f["framing"] == 144 * 2 * 3
    b = X.a2a_bytes([10, 6, 4], [10, 3, 0], rank=0, d_model=8, experts_per_rank=2, backward=True)
    assert b["payload"] - f["payload"] == 32 * 13 and b["calls"] == 5


def test_drops_fall_with_the_capacity_factor_and_the_plots_draw():
    rows = X.drops_by_capacity(factors=(0.5, 1.0, 2.0), tokens=64)
    for k in (1, 2):
        shares = [r["dropped"] for r in rows if r["k"] == k]
        assert shares[0] >= 0.5 and shares == sorted(shares, reverse=True)
    moe = X.MoE()
    with torch.no_grad():
        _, r = moe(X.batch(0, 32, 16))
    assert X.plot_tokens_per_expert({"a": r, "b": r}).axes and X.plot_drops(rows).axes


# ------------------------------------------------------------------ on ranks
CONFIGS = {
    2: [dict(k=1, capacity_factor=1.25), dict(k=2, capacity_factor=1.0),
        dict(k=1, skew=3.0),                                    # rank 1's experts get nothing
        dict(k=2, capacity_factor=None, tokens=5)],
    4: [dict(num_experts=8, k=2, capacity_factor=1.25, tokens=24)],
}


def _every_config(rank, world_size, configs):
    return [X.ep_vs_one_process(rank, world_size, **c) for c in configs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", sorted(CONFIGS))
def test_expert_parallel_equals_one_process_and_sends_what_the_formula_says(n):
    per_rank = lk.run(_every_config, n, args=(CONFIGS[n],), timeout=60, echo=False).values
    for i, config in enumerate(CONFIGS[n]):
        for v in (per_rank[r][i] for r in range(n)):
            where = (config, v["rank"])
            assert v["out_diff"] <= 1e-6 and v["input_grad_diff"] <= 1e-6, where
            assert v["router_grad_diff"] <= 1e-6 and v["expert_grad_diff"] <= 1e-5, where
            assert v["expert_params_here"] * n == v["expert_params_all"], where
            assert v["sent_forward"] == v["formula_forward"]["total"], where
            assert v["sent_forward"] + v["sent_backward"] == v["formula_both"]["total"], where
            assert v["capacity"] == X.capacity(config.get("tokens", 64),
                                               config.get("num_experts", 4), config["k"],
                                               config.get("capacity_factor", 1.25))
    if n == 2:
        skewed = [per_rank[r][2] for r in range(2)]
        assert skewed[1]["recv_rows"] == [0, 0]                 # a rank that receives nothing


def _lab_dispatch_against_the_oracle(rank, world_size):
    import torch.distributed as dist
    results = {}
    for name in check.SCENARIOS:
        data = [check.scenario(name, r, world_size, secret=7) for r in range(world_size)]
        mine = data[rank]
        out = X.dispatch_combine(mine["tokens"], mine["experts"], mine["epr"],
                                 lambda j, rows: check.expert_rows(mine["weights"][j], rows))
        want = check._oracle(data, world_size)[rank]
        results[name] = torch.equal(out, want)
    dist.barrier()
    return results


@pytest.mark.timeout(90)
def test_the_lab_s_own_dispatch_combine_matches_the_checker_s_oracle():
    for per_rank in lk.run(_lab_dispatch_against_the_oracle, 3, timeout=60, echo=False).values:
        assert all(per_rank.values()), per_rank


@pytest.mark.timeout(90)
def test_a_skewed_router_loads_rank_0_and_the_capacity_caps_it():
    small = dict(tokens=64, d_model=16, d_hidden=32, seconds_per_row=1e-4)
    free = X.measure_imbalance(2, skews=(0.0, 3.0), rounds=1, **small)
    assert free[1]["rows_per_rank"] == [128, 0] and free[1]["dropped"] == 0
    assert free[1]["per_rank_expert_ms"][0] > free[1]["per_rank_expert_ms"][1]
    capped = X.measure_imbalance(2, skews=(3.0,), rounds=1, capacity_factor=1.25, **small)
    c = math.ceil(1.25 * 64 / 4)
    assert capped[0]["rows_per_rank"] == [2 * 2 * c, 0] and capped[0]["dropped"] == 128 - 4 * c


@pytest.mark.timeout(120)
def test_bench_rows_has_its_three_tables():
    rows = X.bench_rows(world_sizes=(2,), sizes=(2 ** 10, 2 ** 12), rounds=1, tokens=32,
                        d_model=16, d_hidden=32, stand_in=1e-5)
    tables = {r["table"] for r in rows}
    assert tables == {"all_to_all", "imbalance", "ep_vs_one"}
    assert len([r for r in rows if r["table"] == "imbalance"]) == 4
    text = X.bench_table(rows)
    assert "all_to_all_single on gloo" in text and "speedup" in text
