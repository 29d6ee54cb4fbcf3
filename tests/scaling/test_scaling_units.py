"""Notebook 07's pure logic, no processes: timing rules, cost formulas, predictions, tables."""
from __future__ import annotations

import math

import pytest

from labkit.scaling import (alternating, bubble_formula, busbw_factor, ceiling,
                            cluster_prediction, memory_formula, model_time, powersgd_bytes,
                            ratio_summary, summary, warmup_lr)
from labkit.scaling.batch_lr import diverged
from labkit.scaling.costs import cost_rows, cost_table, fit_link
from labkit.scaling.throughput import scaling_rows, scaling_table


def test_alternating_rounds_reverse_the_order_every_other_round():
    assert alternating([1, 2, 4], 3) == [[1, 2, 4], [4, 2, 1], [1, 2, 4]]
    with pytest.raises(ValueError):
        alternating([1], 0)


def test_summary_and_paired_ratios():
    s = summary([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert s["spread"] == pytest.approx(1.0)
    assert ratio_summary([2.0, 4.0], [1.0, 1.0])["median"] == 3.0
    with pytest.raises(ValueError):
        ratio_summary([1.0], [1.0, 2.0])


def test_ceiling_is_the_core_count():
    assert [ceiling(n, 2) for n in (1, 2, 4)] == [1.0, 2.0, 2.0]
    assert ceiling(4, 8) == 4.0


def _fake_scaling(step_s, cores=2):
    return {"step_s": step_s, "machine": {"cores": cores, "cpu_count": cores, "load": 0.5},
            "settings": dict(sizes=(1, 2), global_batch=8, per_rank_batch=4, width=8, depth=1,
                             warmup=1, steps=1, rounds=2)}


def test_scaling_rows_compute_paired_speedup_and_efficiency():
    sc = _fake_scaling({"strong 1": [1.0, 2.0], "strong 2": [0.5, 2.0],
                        "weak 1": [1.0, 1.0], "weak 2": [1.0, 2.0],
                        "alone 1": [1.0, 1.0], "alone 2": [1.0, 1.0]})
    rows = {(r["mode"], r["ranks"]): r for r in scaling_rows(sc)}
    # round 1: 2x faster, round 2: same time -> paired speedups 2 and 1, median 1.5
    assert rows[("strong", 2)]["speedup"]["median"] == pytest.approx(1.5)
    assert rows[("strong", 2)]["efficiency"]["median"] == pytest.approx(0.75)
    assert rows[("strong", 2)]["batch_per_rank"] == 4 and rows[("weak", 2)]["global_batch"] == 8
    # weak: twice the samples in the same time (round 1) or in twice the time (round 2)
    assert rows[("weak", 2)]["speedup"]["min"] == pytest.approx(1.0)
    assert rows[("weak", 2)]["speedup"]["max"] == pytest.approx(2.0)
    assert rows[("alone", 2)]["ceiling"] == 2.0
    sc["rows"] = scaling_rows(sc)
    assert "usable cores = 2" in scaling_table(sc)


@pytest.mark.parametrize("collective, n, factor", [
    ("all_reduce", 4, 1.5), ("reduce_scatter", 4, 0.75), ("all_gather", 2, 0.5),
    ("all_to_all", 8, 0.875), ("broadcast", 4, 1.0)])
def test_busbw_factors_follow_nccl_tests(collective, n, factor):
    assert busbw_factor(collective, n) == pytest.approx(factor)


def test_alpha_beta_formulas():
    s, a, b = 1e6, 1e-5, 1e-9
    assert model_time("all_reduce", s, 4, a, b) == pytest.approx(6 * a + 1.5 * s * b)
    assert model_time("all_gather", s, 4, a, b) == pytest.approx(3 * a + 0.75 * s * b)
    # ZeRO-3's two all-gathers and one reduce-scatter: 1.5x an all-reduce's bytes
    zero3 = 2 * model_time("all_gather", s, 8, 0, b) + model_time("reduce_scatter", s, 8, 0, b)
    assert zero3 / model_time("all_reduce", s, 8, 0, b) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        model_time("allreduce", s, 2, a, b)


def test_the_fit_recovers_alpha_and_beta_and_predicts_every_collective():
    a, b = 2e-4, 1e-9
    rows = [dict(collective=c, world_size=4, bytes=s, time_s=model_time(c, s, 4, a, b))
            for c in ("all_reduce", "all_gather") for s in (2 ** 16, 2 ** 22)]
    fit = fit_link(rows)[4]
    assert fit["alpha"] == pytest.approx(a, rel=1e-6) and fit["beta"] == pytest.approx(b, rel=1e-6)
    assert all(r["ratio"] == pytest.approx(1.0) for r in cost_rows(rows))
    assert fit["resolved"] and fit["dof"] == 0           # 2 sizes: exact, no uncertainty
    flat = [dict(collective="all_reduce", world_size=4, bytes=s, time_s=t, algbw=s / t / 1e9,
                 busbw=s / t / 1e9 * 1.5)
            for s, t in ((2 ** 16, 3.1e-3), (2 ** 20, 2.9e-3), (2 ** 22, 3.0e-3))]
    assert not fit_link(flat)[4]["resolved"]
    assert "not resolved" in cost_table(cost_rows(flat))


def test_pipeline_formulas():
    assert bubble_formula("GPipe", 4, 12) == pytest.approx(0.2)
    assert bubble_formula("1F1B", 4, 12) == bubble_formula("GPipe", 4, 12)
    assert bubble_formula("Interleaved1F1B", 4, 12) == pytest.approx(3 / 27)
    assert [memory_formula("GPipe", 2, 4, r) for r in (0, 1)] == [4, 4]
    assert [memory_formula("1F1B", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]


def test_powersgd_bytes_counts_p_and_q_and_the_vectors():
    assert powersgd_bytes([(4096, 4096)], 4, element_size=1) == 32768
    assert powersgd_bytes([(8, 2, 3), (5,)], 2, element_size=4) == ((8 + 6) * 2 + 5) * 4


def test_cluster_prediction_is_monotone_in_what_it_models():
    rows = cluster_prediction(124e6, 8192, gpus=(1, 8, 64))
    assert rows[0]["efficiency"] == 1.0 and rows[0]["allreduce_s"] == 0.0
    assert rows[2]["allreduce_s"] > rows[1]["allreduce_s"] > 0          # more GPUs, more steps
    assert rows[1]["efficiency"] == 1.0 > rows[2]["efficiency"]         # the ring's latency
    assert rows[1]["buckets"] == 20              # 496 MB: DDP's first bucket of 1 MiB, then 25 MiB each
    assert cluster_prediction(124e6, 8192, gpus=(8,), bucket_mib=1024)[0]["buckets"] == 1
    one = cluster_prediction(124e6, 8192, gpus=(64,), bucket_mib=1024)[0]
    assert one["efficiency"] == 1.0           # one bucket: 8 NICs per node move it in time
    small = cluster_prediction(124e6, 1024, gpus=(8,))[0]
    assert small["efficiency"] < rows[1]["efficiency"]         # less work per GPU: less hidden
    none = cluster_prediction(124e6, 8192, gpus=(8,), overlap=0.0)[0]
    assert none["exposed_s"] == pytest.approx(none["allreduce_s"])


def test_warmup_and_divergence():
    assert [warmup_lr(0.4, s, 4) for s in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert warmup_lr(0.4, 0, 0) == 0.4
    assert diverged([1.0, math.inf]) and diverged([1.0, 11.0]) and not diverged([1.0, 0.5])
