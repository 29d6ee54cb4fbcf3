"""labkit.sequences_experts.activations (notebook 09): what a block keeps for backward, measured
beside Korthikanti et al.'s count; activation checkpointing. One process, small shapes."""
from __future__ import annotations

import matplotlib
import pytest
import torch

from labkit.sequences_experts import activations as A
from labkit.capstone.model import Block as GPTBlock

matplotlib.use("Agg")
S, B, H, HEADS = 32, 2, 32, 4


def test_every_term_measured_is_the_formula_s_term_in_fp32_with_byte_masks():
    rows = A.measure_block(S, B, H, HEADS)
    by = {r["term"]: r for r in rows}
    for tag, *_ in A.TERMS:
        assert by[tag]["measured"] == by[tag]["formula"], tag
    sbh, as2b = S * B * H, HEADS * S * S * B
    assert by["total"]["formula"] == 66 * sbh + 9 * as2b
    # the only difference: two LayerNorms' mean and 1/σ, fp32, per token
    assert by[A.STATS]["measured"] == 16 * S * B
    assert by["total"]["measured"] == by["total"]["formula"] + 16 * S * B


def test_sdpa_keeps_no_s_squared_tensor_and_the_rows_still_add_up():
    rows = A.measure_block(S, B, H, HEADS, attention="sdpa")
    by = {r["term"]: r for r in rows}
    assert all(r["measured"] == r["formula"] for r in rows if r["formula"] is not None
               and r["term"] != "total")
    assert "softmax output" not in by
    small, big = (A.sweep((s,), B, H, HEADS)[0] for s in (S, 2 * S))
    assert big["sdpa"] == 2 * small["sdpa"]                        # linear in s
    assert big["materialised"] > 2 * small["materialised"]         # the s² terms
    assert big["materialised"] == big["formula"]


def test_the_formula_at_16_bits_is_korthikanti_s_for_every_layout():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    def total(layout, n=1):
        return sum(A.block_formula(s, b, h, a, n, layout, e=2, stats=False).values())
    assert total("one process") == A.korthikanti_bytes(s, b, h, a) \
        == s * b * h * (34 + 5 * a * s / h)
    assert total("tp", t) == pytest.approx(A.korthikanti_bytes(s, b, h, a, t))
    assert total("tp+sp regather", t) == pytest.approx(A.korthikanti_bytes(s, b, h, a, t, sp=True))
    # plain sequence parallelism keeps the two gathered inputs whole: 4·sbh at 16 bits
    assert total("tp+sp", t) == pytest.approx(total("tp+sp regather", t)
                                              + 4 * s * b * h * (1 - 1 / t))


def test_torch_dropout_on_cpu_keeps_a_four_byte_mask():
    assert A.torch_dropout_mask_bytes(1000) == 4000
    rows = {r["term"]: r for r in A.measure_block(S, B, H, HEADS, dropout="torch")}
    for tag in ("attention dropout mask", "dropout mask after attention",
                "dropout mask after the MLP"):
        assert rows[tag]["measured"] == 4 * rows[tag]["formula"]


def test_keep_masks_of_pieces_are_the_whole_mask_s_pieces():
    whole = A.keep_mask(((8, 0, 8), (2, 0, 2), (6, 0, 6)), 0.25, seed=3)
    top = A.keep_mask(((4, 0, 8), (2, 0, 2), (6, 0, 6)), 0.25, seed=3)
    bottom = A.keep_mask(((4, 4, 8), (2, 0, 2), (6, 0, 6)), 0.25, seed=3)
    assert torch.equal(torch.cat([top, bottom]), whole) and whole.dtype == torch.bool
    many = A.keep_mask(((100_000, 0, 100_000),), 0.25, seed=0)
    assert abs(1 - many.float().mean().item() - 0.25) < 0.01
    u = A._hash(torch.arange(100_000), 0).double()                  # neighbours and seeds:
    for other in (u.roll(1), u.roll(64), A._hash(torch.arange(100_000), 1).double()):
        assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 0.02   # uncorrelated
    assert not torch.equal(whole, A.keep_mask(((8, 0, 8), (2, 0, 2), (6, 0, 6)), 0.25, seed=4))


def test_the_block_is_notebook_08_s_block_written_out():
    """Without dropout, the written-out forward in [s, b, h] equals the capstone block's."""
    for attention in A.ATTENTIONS:
        block = A.make_block(H, HEADS, p=0.0, attention=attention)
        x = torch.randn(S, B, H)
        ours = block(x)
        theirs = GPTBlock.forward(block, x.transpose(0, 1)).transpose(0, 1)
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_recomputation_keeps_less_reruns_forwards_and_gives_equal_gradients():
    s, b, h, a, layers = 32, 2, 32, 4, 2
    rows = {r["way"]: r for r in A.recompute_costs(s, b, h, a, layers=layers, rounds=1)}
    full_formula = sum(A.block_formula(s, b, h, a).values())
    assert rows["none"]["saved_per_layer"] == full_formula
    assert rows["selective"]["saved_per_layer"] == full_formula - 9 * a * s * s * b
    assert rows["full"]["saved_per_layer"] == 4 * s * b * h              # the block's input
    ways = ("none", "selective", "full")
    assert [rows[w]["forwards"] for w in ways] == [1, 1, 2]
    assert [rows[w]["cores"] for w in ways] == [1, 2, 2]
    assert all(r["equal"] and r["max_grad_diff"] == 0.0 for r in rows.values())
    assert all(r["fwd_bwd_ms"] > 0 for r in rows.values())


def test_saved_tensors_counts_a_storage_once_and_leaves_parameters_out():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 4, 8, requires_grad=True)
    with A.SavedTensors(exclude=lin.parameters()) as saved:
        lin(x)
        torch.sin(x.view(12, 8))                                   # keeps a view of x
    assert saved.packed >= 3 and saved.total == x.numel() * 4       # x once, no weight


@pytest.mark.parametrize("kwargs, word", [({"attention": "flash"}, "attention"),
                                         ({"dropout": "cuda"}, "dropout"),
                                         ({"recompute": "all"}, "recompute")])
def test_a_wrong_option_is_refused_by_name(kwargs, word):
    with pytest.raises(ValueError, match=word):
        A.make_block(H, HEADS, **kwargs)
    with pytest.raises(ValueError, match="h=30"):
        A.make_block(30, 4)
    with pytest.raises(ValueError, match="layout"):
        A.block_formula(S, B, H, HEADS, layout="pp")


def test_the_plot_draws_measured_and_formula():
    ax = A.plot_sweep(A.sweep((16, 32), B, H, HEADS))
    assert len(ax.lines) == 4
