"""labkit.sequences_experts.attention: the oracle, the log-sum-exp merge, the layouts, the ring
(both layouts, forward and backward) and Ulysses against the oracle on every rank, and the
bytes each rank's gloo sockets sent against the formulas.

The multi-rank tests share one job per world size (:func:`runs`, module scope): each rank runs
:func:`~labkit.sequences_experts.attention.measure_job` not causal and causal, then asks Ulysses
for a head count the world size does not divide.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.sequences_experts import attention as A

TOL = 1e-5


def _qkv(heads=3, seq=12, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, seq, dim, generator=g) for _ in range(3)]


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("causal", [False, True])
def test_the_oracle_is_sdpa_and_its_lse_is_the_log_of_the_denominator(causal):
    q, k, v = _qkv()
    out, lse = A.attention_lse(q, k, v, causal=causal)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               atol=TOL, rtol=0)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=TOL, rtol=0)


def test_a_row_that_sees_no_key_is_zero_with_lse_minus_infinity():
    q, k, v = _qkv(seq=4)
    out, lse = A.attention_lse(q, k, v, causal=True, q_start=0, k_start=2)   # rows 0, 1: none
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert bool(torch.isinf(lse[:, :2]).all()) and bool(torch.isfinite(lse[:, 2:]).all())


@pytest.mark.parametrize("causal, cut", [(False, 5), (True, 5), (True, 9)])
def test_merging_two_blocks_of_keys_gives_the_whole(causal, cut):
    """The LSE merge of two key blocks (positions kept for the causal mask) is attention over
    both, in either order; a plain average is not."""
    q, k, v = _qkv()
    want, want_lse = A.attention_lse(q, k, v, causal=causal)
    a = A.attention_lse(q, k[:, :cut], v[:, :cut], causal=causal, k_start=0)
    b = A.attention_lse(q, k[:, cut:], v[:, cut:], causal=causal, k_start=cut)
    for first, second in ((a, b), (b, a)):
        out, lse = A.merge_partials(*first, *second)
        torch.testing.assert_close(out, want, atol=TOL, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=TOL, rtol=0)
    assert float(((a[0] + b[0]) / 2 - want).abs().max()) > 1e-2


def test_merging_two_empty_parts_gives_zeros_not_nan():
    out = torch.ones(2, 3)
    empty = torch.full((2,), float("-inf"))
    merged, lse = A.merge_partials(out, empty, out, empty)
    assert torch.equal(merged, torch.zeros(2, 3)) and bool(torch.isinf(lse).all())


@pytest.mark.parametrize("layout", A.LAYOUTS)
def test_every_rank_s_chunks_put_back_together_are_the_sequence(layout):
    x = torch.arange(2 * 3 * 24.0).view(2, 24, 3)                 # [heads, seq, dim]
    blocks = [A.shard_sequence(x, r, 3, layout, dim=1) for r in range(3)]
    assert torch.equal(A.unshard_sequence(blocks, layout, dim=1), x)
    assert sorted(c for r in range(3) for c in A.rank_chunks(r, 3, layout)) == list(range(6))
    assert A.rank_chunks(1, 3, "balanced") == [1, 4]
    with pytest.raises(ValueError, match="multiple of 6"):
        A.shard_sequence(torch.zeros(2, 10, 3), 0, 3, layout)
    with pytest.raises(ValueError, match="layout must be one of"):
        A.rank_chunks(0, 2, "zigzag")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_work_per_rank_of_each_layout(n):
    """Causal, contiguous: 4r + 3 chunk pairs on rank r (the last rank 4N - 1, the first 3);
    balanced: 2N + 1 everywhere; the same total N(2N + 1); not causal: 4N everywhere."""
    assert A.ring_work(n, "contiguous") == [4 * r + 3 for r in range(n)]
    assert A.ring_work(n, "balanced") == [2 * n + 1] * n
    assert sum(A.ring_work(n, "contiguous")) == sum(A.ring_work(n, "balanced")) == n * (2 * n + 1)
    assert A.ring_work(n, "contiguous", causal=False) == [4 * n] * n


def test_the_byte_formulas():
    """Ring forward: N-1 K/V blocks, 2(N-1)/N·S·H·D·4; Ulysses forward: 4(N-1)/N²·S·H·D·4,
    so the ring sends N/2 times as much: the same on 2 ranks, twice as much on 4."""
    h, s, d = 8, 1024, 64
    unit = s * h * d * 4
    for n in (2, 4, 8):
        assert A.ring_bytes(h, s, d, n) == 2 * (n - 1) * unit // n
        assert A.ulysses_bytes(h, s, d, n) == 4 * (n - 1) * unit // n ** 2
        assert A.ring_bytes(h, s, d, n) == n // 2 * A.ulysses_bytes(h, s, d, n)
        assert A.ring_bytes(h, s, d, n, backward=True) == 2 * (n - 1) * unit // n * (1 + 1) \
            + 2 * unit // n * n
        assert A.ulysses_bytes(h, s, d, n, backward=True) == 2 * A.ulysses_bytes(h, s, d, n)
    assert A.scores_bytes(32, 131_072) == 32 * 131_072 ** 2 * 4


# ------------------------------------------------------------------ on real ranks
def _job(rank, world_size):
    import torch

    from labkit.sequences_experts import attention as A
    rows = {causal: A.measure_job(rank, world_size, heads=12, seq=8 * world_size, head_dim=8,
                                  causal=causal) for causal in (False, True)}
    few = world_size + 1                          # heads the world size does not divide
    try:
        A.ulysses_attention(*(torch.zeros(few, 4, 8) for _ in range(3)))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return rows, refused


@pytest.fixture(scope="module")
def runs():
    return {n: lk.run(_job, n, backend="gloo", timeout=60, echo=False).values
            for n in (2, 3, 4)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_and_ulysses_equal_the_oracle_forward_and_backward_on_every_rank(runs, n):
    for rank, (rows, _) in enumerate(runs[n]):
        for causal, methods in rows.items():
            for method, row in methods.items():
                assert row["out_err"] < TOL and row["grad_err"] < TOL, (n, rank, causal, method,
                                                                        row["out_err"],
                                                                        row["grad_err"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_bytes_sent_are_the_formula_plus_gloo_s_framing(runs, n):
    """Counted by the kernel on gloo's sockets: ring forward N-1 messages, backward 2N-1 more;
    Ulysses two all-to-alls each way, one message to each of the N-1 peers. 144 bytes of
    framing per message."""
    h, s, d = 12, 8 * n, 8
    for rank, (rows, _) in enumerate(runs[n]):
        for methods in rows.values():
            for method in ("ring", "balanced"):
                row = methods[method]
                assert row["collectives_fwd"] == [] and row["unwatched"] == ""
                assert row["sent_fwd"] == A.ring_bytes(h, s, d, n) + A.FRAMING * (n - 1)
                assert row["sent_bwd"] == (A.ring_bytes(h, s, d, n, backward=True)
                                           - A.ring_bytes(h, s, d, n)
                                           + A.FRAMING * (2 * n - 1))
            u = methods["ulysses"]
            assert u["collectives_fwd"] == ["gloo:all_to_all"] * 2
            assert u["sent_fwd"] == u["sent_bwd"] == (A.ulysses_bytes(h, s, d, n)
                                                      + A.FRAMING * 2 * (n - 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_rank_computes_the_chunk_pairs_its_layout_gives_it(runs, n):
    for causal in (False, True):
        for layout, method in (("contiguous", "ring"), ("balanced", "balanced")):
            got = [rows[causal][method]["pairs"] for rows, _ in runs[n]]
            assert got == A.ring_work(n, layout, causal), (causal, layout, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_next_block_is_posted_before_the_current_one_is_computed(runs, n):
    for rows, _ in runs[n]:
        steps = rows[True]["ring"]["steps"]
        assert [st["block"] for st in steps] == [(steps[0]["block"] - s) % n for s in range(n)]
        for st in steps[:-1]:
            assert st["posted"] <= st["compute"][0] <= st["compute"][1] <= st["waited"][1]
        assert steps[-1]["posted"] is None               # nothing left to fetch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ulysses_refuses_heads_the_world_size_does_not_divide(runs, n):
    for _, refused in runs[n]:
        assert refused.startswith(f"Ulysses gives each rank whole heads: {n + 1} heads cannot "
                                  f"be split over {n} ranks ({n + 1} % {n} = 1)")
        assert "multiple of the number of ranks" in refused


@pytest.mark.timeout(120)
def test_bench_rows_time_every_method_and_count_its_bytes():
    rows = A.bench_rows(world_sizes=(2,), heads=2, seq=16, head_dim=4, repeats=1)
    assert [r["method"] for r in rows] == ["one process", "ring (contiguous)",
                                          "ring (load-balanced)", "Ulysses"]
    assert all(r["ms"] > 0 for r in rows)
    by = {r["method"]: r for r in rows}
    assert by["ring (contiguous)"]["sent"] == by["ring (contiguous)"]["formula"] + A.FRAMING * 4
    assert by["Ulysses"]["sent"] == by["Ulysses"]["formula"] + A.FRAMING * 4
    assert "| 2 | Ulysses |" in A.bench_table(rows)
