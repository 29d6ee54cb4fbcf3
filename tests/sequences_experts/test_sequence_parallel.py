"""labkit.sequences_experts.sequence_parallel (notebook 09): tensor parallelism with and without
sequence parallelism on 2 and 4 real gloo ranks, against one process; activation bytes and bytes
on the wire against their formulas; the refusals."""
from __future__ import annotations

import sys

import cloudpickle
import matplotlib
import pytest

import labkit as lk
from labkit.sequences_experts import sequence_parallel as SP

matplotlib.use("Agg")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(180)

SHAPE = dict(s=16, b=2, h=32, a=4)


def _check_rows(per_rank: list[list[dict]], n: int) -> None:
    s, b, h = SHAPE["s"], SHAPE["b"], SHAPE["h"]
    for rows in per_rank:
        by = {r["setup"]: r for r in rows}
        for r in rows:
            assert max(r["out_diff"], r["x_grad_diff"], r["grad_diff"]) < 1e-5, r["setup"]
            assert r["activation_bytes"] == r["activation_formula"], r["setup"]
            if r["comm"] == "ring":
                assert r["sent"] == r["sent_formula"]["wire"], r["setup"]
                assert r["gloo_collectives"] == []          # only the ring's isend/irecv
        # sequence parallelism: the same bytes as tensor parallelism's all-reduces ...
        assert by["TP+SP"]["ring_sent"] == by["TP"]["ring_sent"] == 8 * (n - 1) / n * 4 * s * b * h
        # ... and less memory; regathering: all of it 1/N, for two all-gathers more
        one = by["TP"]["one_process_bytes"]
        assert one / n == by["TP+SP regather"]["activation_bytes"] \
            < by["TP+SP"]["activation_bytes"] < by["TP"]["activation_bytes"] < one
        assert by["TP+SP regather"]["ring_sent"] == 10 / 8 * by["TP"]["ring_sent"]
        if rows[0]["comm"] == "ring":
            assert by["TP+SP"]["sent"] == by["TP"]["sent"]   # measured on the sockets
            six_h = 4 * 6 * h                                 # replicated gradients, fp32
            half = (n - 1) * six_h // n + (n - 1) * SP.FRAMING_BYTES
            assert by["TP+SP"]["sync_sent"] == 2 * half                # one ring all-reduce
        assert by["TP"]["sync_sent"] == 0


def _ring_and_refusals(rank, world_size):
    import torch
    from labkit.sequences_experts.activations import make_block
    rows = SP.compare(rank, world_size, **SHAPE)
    refused = {}
    try:
        SP.shard_sequence(torch.randn(2 * world_size + 1, 2, SHAPE["h"]))
    except ValueError as exc:
        refused["s"] = str(exc)
    try:
        SP.compare(rank, world_size, **{**SHAPE, "s": 2 * world_size + 1})
    except ValueError as exc:
        refused["compare s"] = str(exc)
    for kwargs in (dict(mode="cp"), dict(comm="nccl"), dict(mode="tp", regather=True)):
        try:
            SP.ParallelBlock(make_block(SHAPE["h"], SHAPE["a"]), **kwargs)
        except ValueError as exc:
            refused[str(kwargs)] = str(exc)
    try:
        SP.ParallelBlock(make_block(36, 3))               # 3 heads: not over 2 or 4 ranks
    except ValueError as exc:
        refused["heads"] = str(exc)
    try:
        SP.ParallelBlock(make_block(SHAPE["h"], SHAPE["a"], dropout="torch"))
    except ValueError as exc:
        refused["torch dropout"] = str(exc)
    return rows, refused


@pytest.mark.parametrize("n", [2, 4])
def test_tp_and_tp_sp_equal_one_process_and_send_what_the_formulas_say(n):
    values = lk.run(_ring_and_refusals, n, timeout=90, echo=False).values
    _check_rows([rows for rows, _ in values], n)
    for _, refused in values:
        for key in ("s", "compare s"):
            text = refused[key]
            assert f"sequence length s={2 * n + 1} " in text and f"over {n} ranks" in text
        assert "mode=" in refused["{'mode': 'cp'}"] and "comm=" in refused["{'comm': 'nccl'}"]
        assert "regather" in refused["{'mode': 'tp', 'regather': True}"]
        assert "n_head=" in refused["heads"] and "dropout='hashed'" in refused["torch dropout"]


def test_torch_collectives_give_the_same_results_and_payloads():
    values = lk.run(SP.compare, 2, kwargs=dict(comm="torch", **SHAPE), timeout=90,
                    echo=False).values
    _check_rows(values, 2)
    by = {r["setup"]: r for r in values[0]}
    payload = 4 * 16 * 2 * 32                                      # one fp32 activation s·b·h
    assert by["TP"]["kinds"]["forward"] == {"all_reduce": {"calls": 2, "bytes": 2 * payload}}
    assert set(by["TP+SP"]["kinds"]["forward"]) == {"all_gather", "reduce_scatter"}
    assert by["TP+SP regather"]["kinds"]["backward"]["all_gather"]["calls"] == 4


def test_shapes_that_do_not_divide_are_refused_naming_the_parameter():
    with pytest.raises(ValueError, match=r"sequence length s=15 .* 2 ranks"):
        SP.check_shapes(15, 2, 4, 32)
    with pytest.raises(ValueError, match=r"n_head=6 heads .* 4 ranks"):
        SP.check_shapes(16, 4, 6, 36)
    with pytest.raises(ValueError, match=r"n_embd=30"):
        SP.check_shapes(16, 2, 4, 30)
    SP.check_shapes(16, 4, 4, 32)


def test_the_traffic_formula_counts_ring_halves():
    f = SP.sent_formula("tp", 16, 2, 32, 2)
    assert f["halves"] == 8 and f["payload"] == 8 * 4 * 16 * 2 * 32 // 2
    assert f["wire"] == f["payload"] + 8 * SP.FRAMING_BYTES
    assert SP.sent_formula("tp+sp", 16, 2, 32, 4) == SP.sent_formula("tp", 16, 2, 32, 4)
    assert SP.sent_formula("tp+sp", 16, 2, 32, 4, regather=True)["halves"] == 10


def test_bench_rows_report_both_setups():
    rows = SP.bench_rows(2, s=16, b=2, h=32, a=4, rounds=1)
    assert [r["setup"] for r in rows] == ["TP", "TP+SP", "TP+SP regather"]
    assert all(r["activation_bytes"] == r["activation_formula"] and r["sent"] == r["sent_formula"]
               and r["step_ms"] > 0 and r["max_diff"] < 1e-5 for r in rows)
    text = SP.table(rows)
    assert text.count("\n") == 4 and "TP+SP regather" in text


def test_the_regions_picture_draws():
    ax = SP.plot_regions(2)
    assert len(ax.patches) == 12
