"""Attention over a sequence split across ranks: context parallelism (notebook 09, §4 to §9).

A sequence of S tokens, split in N blocks of S/N, one block per rank. Everything in a
transformer block works token by token except attention: query i needs *every* key and value
(causal: every earlier one). Two ways to give it them without any rank holding the S × S scores:

* **ring attention** (Liu, Zaharia and Abbeel, 2023, "Ring Attention with Blockwise
  Transformers"): each rank keeps its query block and passes key/value blocks around a ring with
  ``isend``/``irecv``; after N - 1 steps every query block has met every key/value block. Each
  step's partial result is merged with the running one by the **log-sum-exp** trick (the online
  softmax of Milakov and Gimelshein, 2018, used block by block in Dao et al.'s FlashAttention,
  2022): a block's output is normalised by its own softmax denominator, and its log-sum-exp
  ``lse`` says how to rescale it when the next block's keys arrive (:func:`merge_partials`).
  The next transfer is posted *before* the current block is computed, so it can overlap;
* **Ulysses** (Jacobs et al., 2023, "DeepSpeed Ulysses"): one ``all_to_all`` turns
  sequence-sharded q, k, v into head-sharded ones (each rank: H/N heads, the whole sequence),
  plain attention runs locally, a second ``all_to_all`` turns the output back. It needs the
  number of heads to be a multiple of the number of ranks (:func:`ulysses_attention` refuses
  otherwise).

Causal attention makes a contiguous split uneven: rank r's queries see r + 1 blocks of keys, so
the last rank computes about 2N - 1 times what the first one does. The **load-balanced** split
cuts the sequence in 2N chunks and gives rank r chunks r and 2N - 1 - r (one early, one late):
every rank then computes the same number of chunk pairs (:func:`ring_work`, ``layout=
"balanced"``). Bytes per rank per forward (fp32, H heads, head size D, S tokens, N ranks):
ring ``2 (N-1)/N · S·H·D·4`` (N - 1 blocks of K and V), Ulysses ``4 (N-1)/N² · S·H·D·4``
(two all-to-alls, of q, k, v and of the output: four blocks, of which 1/N stays home):
:func:`ring_bytes`, :func:`ulysses_bytes`, checked against gloo's socket counters in the tests
and the notebook.

Every tensor here is ``[heads, length, head_dim]`` (extra leading dimensions broadcast), fp32.
The oracle is :func:`attention_lse`, one process, the whole sequence.

Example (inside a rank; q, k, v the whole sequence, the same on every rank)::

    mine = [SX.attention.shard_sequence(t, rank, world_size, "balanced") for t in (q, k, v)]
    out = SX.attention.ring_attention(*mine, causal=True, layout="balanced")   # this rank's rows
    full, _ = SX.attention.attention_lse(q, k, v, causal=True)
    torch.testing.assert_close(out, SX.attention.shard_sequence(full, rank, world_size, "balanced"))
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from ..grading.references import reference
from .experts import all_to_all

__all__ = ["attention_lse", "merge_partials", "LAYOUTS", "FRAMING", "rank_chunks", "shard_sequence",
           "unshard_sequence", "pair_kind", "ring_work", "ring_attention", "ulysses_attention",
           "ring_bytes",
           "ulysses_bytes", "ring_messages", "measure_job", "imbalance_job", "ring_spans",
           "plot_ring", "plot_work", "bench_rows", "bench_table", "scores_bytes"]

LAYOUTS = ("contiguous", "balanced")
FRAMING = 144     # gloo's bytes on the wire per message, torch 2.13: 96 with the message and
# 48 from its receiver, so 144 per message where a rank sends as many as it receives (a ring
# step, an all-to-all's N - 1 peers); tests/claims/test_claims_sequences_experts_attention.py
_KV_TAG, _GRAD_TAG = 0, 1        # the backward's two kinds of message travel the same links


# ------------------------------------------------------------------ one process
def attention_lse(q, k, v, causal: bool = False, q_start: int = 0, k_start: int = 0,
              scale: float | None = None):
    """Multi-head attention in one process, fp32: ``(out, lse)``.

    ``q`` is ``[..., Lq, D]``, ``k`` and ``v`` ``[..., Lk, D]``; ``out = softmax(q kᵀ · scale)
    v`` (``scale`` = 1/√D unless given) and ``lse[..., i] = log Σ_j exp(s_ij)``, the log of the
    softmax's denominator of row i, over the keys row i may see. ``causal``: query i sits at
    position ``q_start + i``, key j at ``k_start + j``, and a query sees the keys at its position
    and before. A row that sees no key has output 0 and lse -inf (the ring never asks for one).
    Differentiable (autograd) in q, k and v.
    """
    q, k, v = q.float(), k.float(), v.float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        qi = torch.arange(q.shape[-2], device=q.device) + q_start
        kj = torch.arange(k.shape[-2], device=q.device) + k_start
        s = s.masked_fill(kj[None, :] > qi[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))    # a row that sees nothing
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out, (m + torch.log(denom)).squeeze(-1)


@reference
def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two attention results of the same queries over two disjoint sets of keys, merged into the
    result over both: ``(out, lse)``.

    Each ``out`` is normalised by its own softmax denominator ``exp(lse)``; the merged
    denominator is ``exp(lse_a) + exp(lse_b)``, so ``lse = logaddexp(lse_a, lse_b)`` and each
    part is reweighted by its share: ``out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b``.
    Exact (up to rounding) in any order, which is what lets the ring take blocks as they come.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)   # both parts empty
    out = (torch.exp(lse_a - safe).unsqueeze(-1) * out_a
           + torch.exp(lse_b - safe).unsqueeze(-1) * out_b)
    return out, lse


def scores_bytes(heads: int, seq: int, itemsize: int = 4) -> int:
    """Bytes of one layer's attention scores for one sequence: heads × S × S numbers."""
    return heads * seq * seq * itemsize


# ------------------------------------------------------------------ layouts
def rank_chunks(rank: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """The two chunks (of 2N) of the sequence that ``rank`` holds: ``[2r, 2r+1]`` contiguous
    (block r), ``[r, 2N-1-r]`` load-balanced (one early, one late chunk)."""
    if layout == "contiguous":
        return [2 * rank, 2 * rank + 1]
    if layout == "balanced":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x, rank: int, world_size: int, layout: str = "contiguous", dim: int = -2):
    """This rank's rows of a whole-sequence tensor (sequence along ``dim``): its two chunks, in
    order. The length must be a multiple of 2N."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens cannot be cut in 2 × "
                         f"{world_size} equal chunks: make it a multiple of {2 * world_size}")
    pieces = x.chunk(2 * world_size, dim=dim)
    return torch.cat([pieces[c] for c in rank_chunks(rank, world_size, layout)], dim=dim)


def unshard_sequence(blocks: list, layout: str = "contiguous", dim: int = -2):
    """The whole sequence from every rank's block (``blocks[r]``, cut by
    :func:`shard_sequence`)."""
    n = len(blocks)
    pieces = [None] * (2 * n)
    for r, b in enumerate(blocks):
        for c, piece in zip(rank_chunks(r, n, layout), b.chunk(2, dim=dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """What a query chunk computes against a key chunk: ``"full"`` (every key visible),
    ``"diagonal"`` (the same chunk, causal: the lower triangle) or None (causal, all keys
    later: nothing to compute)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else None


def _pairs(rank: int, j: int, n: int, layout: str, causal: bool):
    """The chunk pairs ``rank`` computes while it holds rank ``j``'s K/V block: ``(a, b,
    diagonal)`` for its query chunk a and the block's key chunk b (0 or 1 each), skipping the
    pairs a causal mask leaves empty."""
    for a, qc in enumerate(rank_chunks(rank, n, layout)):
        for b, kc in enumerate(rank_chunks(j, n, layout)):
            kind = pair_kind(qc, kc, causal)
            if kind is not None:
                yield a, b, kind == "diagonal"


def ring_work(world_size: int, layout: str = "contiguous", causal: bool = True) -> list[int]:
    """Chunk pairs each rank's ring computes (a diagonal pair counts as one): the work per rank,
    from the schedule alone. Contiguous causal: 4r + 3 on rank r; balanced: 2N + 1 on every
    rank; not causal: 4N everywhere."""
    n = world_size
    return [sum(1 for j in range(n) for _ in _pairs(r, j, n, layout, causal)) for r in range(n)]


# ------------------------------------------------------------------ the ring
def _neighbours(group):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return n, rank, glob((rank + 1) % n), glob((rank - 1) % n)


def _post(send, recv, right: int, left: int, group, tag: int) -> list:
    """Post a receive from the left and a send to the right; return their works (not waited)."""
    works = []
    if recv is not None:
        works.append(dist.irecv(recv, src=left, group=group, tag=tag))
    if send is not None:
        works.append(dist.isend(send, dst=right, group=group, tag=tag))
    return works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _ring_forward(q, k, v, causal, layout, group, stats):
    n, rank, right, left = _neighbours(group)
    qs = q.chunk(2, dim=-2)
    acc = [None, None]                                     # (out, lse) per query chunk
    kv = torch.stack([k, v]).contiguous()
    pairs, compute_s, compute_cpu, steps = 0, 0.0, 0.0, []
    for s in range(n):
        j = (rank - s) % n                                 # the rank whose block we hold now
        works, posted = [], time.perf_counter()
        if s < n - 1:                                      # the next block travels meanwhile
            incoming = torch.empty_like(kv)
            works = _post(kv, incoming, right, left, group, _KV_TAG)
        t0, c0 = time.perf_counter(), time.thread_time()
        ks, vs = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
        for a, b, diagonal in _pairs(rank, j, n, layout, causal):
            o, lse = attention_lse(qs[a], ks[b], vs[b], causal=diagonal)
            acc[a] = (o, lse) if acc[a] is None else merge_partials(*acc[a], o, lse)
            pairs += 1
        t1 = time.perf_counter()
        compute_cpu += time.thread_time() - c0
        _wait(works)
        t2 = time.perf_counter()
        steps.append({"step": s, "block": j, "posted": posted if works else None,
                      "compute": (t0, t1), "waited": (t1, t2)})
        compute_s += t1 - t0
        if works:
            kv = incoming
    out = torch.cat([a[0] for a in acc], dim=-2)
    lse = torch.cat([a[1] for a in acc], dim=-1)
    if stats is not None:
        c = q.shape[-2] // 2
        stats.update(pairs=pairs, scores=pairs * c * c * math.prod(q.shape[:-2]),
                     compute_s=compute_s, compute_cpu_s=compute_cpu, steps=steps,
                     world_size=n, rank=rank,
                     layout=layout, causal=causal)
    return out, lse


def _pair_backward(qa, oa_delta, doa, lsea, kb, vb, diagonal, scale):
    """Gradients of one (query chunk, key chunk) pair: dq_a, dk_b, dv_b (flash-attention's
    backward with the final lse: P = exp(S - lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - δ))."""
    s = (qa @ kb.transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    p = torch.exp(s - lsea.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ doa
    ds = p * (doa @ vb.transpose(-1, -2) - oa_delta.unsqueeze(-1))
    return (ds @ kb) * scale, (ds.transpose(-1, -2) @ qa) * scale, dv


def _ring_backward(q, k, v, out, lse, dout, causal, layout, group):
    """The ring again: K/V blocks travel as in forward, and with each block the sum of its
    dK/dV contributions so far; after N steps each block's gradients come home."""
    n, rank, right, left = _neighbours(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout = dout.float()
    delta = (dout * out).sum(-1)                            # δ_i = Σ_d dO_id O_id
    qs, dos, lses, deltas = (t.chunk(2, dim=-2 if t.dim() == q.dim() else -1)
                             for t in (q, dout, lse, delta))
    qs, dos, lses, deltas = list(qs), list(dos), list(lses), list(deltas)
    dq = [torch.zeros_like(x) for x in qs]
    kv = torch.stack([k, v]).contiguous()
    sends = []
    for s in range(n):
        j = (rank - s) % n
        kv_works, incoming = [], None
        if s < n - 1:
            incoming = torch.empty_like(kv)
            kv_works = _post(kv, incoming, right, left, group, _KV_TAG)
        grad_in = torch.empty_like(kv) if s > 0 else None
        grad_works = _post(None, grad_in, right, left, group, _GRAD_TAG) if s > 0 else []
        local = torch.zeros_like(kv)                        # this step's dK, dV of block j
        ks, vs = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
        dks, dvs = local[0].chunk(2, dim=-2), local[1].chunk(2, dim=-2)
        for a, b, diagonal in _pairs(rank, j, n, layout, causal):
            dqa, dkb, dvb = _pair_backward(qs[a], deltas[a], dos[a], lses[a], ks[b], vs[b],
                                           diagonal, scale)
            dq[a] += dqa
            dks[b].add_(dkb)
            dvs[b].add_(dvb)
        _wait(grad_works)
        if grad_in is not None:
            local += grad_in                                # what the earlier ranks added
        sends += _post(local, None, right, left, group, _GRAD_TAG)
        _wait(kv_works)
        if incoming is not None:
            kv = incoming
    home = torch.empty_like(kv)                             # my block, every rank's share in it
    _wait(_post(None, home, right, left, group, _GRAD_TAG))
    _wait(sends)
    return torch.cat(dq, dim=-2), home[0], home[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group, stats):
        out, lse = _ring_forward(q.float(), k.float(), v.float(), causal, layout, group, stats)
        ctx.save_for_backward(q.float(), k.float(), v.float(), out, lse)
        ctx.args = (causal, layout, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None


@reference
def ring_attention(q, k, v, causal: bool = False, layout: str = "contiguous", group=None,
                   stats: dict | None = None):
    """This rank's block of attention output, computed by a ring (inside a rank).

    ``q``, ``k``, ``v``: this rank's rows of the sequence, ``[..., L, D]`` with L even, cut as
    :func:`shard_sequence` cuts them for ``layout`` (``"contiguous"``: block r; ``"balanced"``:
    chunks r and 2N-1-r). K and V travel together, one message per step to the right
    neighbour; the next message is posted before the current block is computed. Causal pairs
    with nothing visible are skipped; every block still travels the whole ring (the balanced
    layout needs them all).
    Differentiable: backward runs the ring again (hand-written, flash-attention style) and
    returns this rank's dq, dk, dv. ``stats``, if given, is filled with the chunk pairs this
    rank computed (``pairs``, ``scores``), its compute seconds (``compute_s``, wall clock;
    ``compute_cpu_s``, CPU time of the thread) and each step's times.
    """
    if q.shape[-2] % 2:
        raise ValueError(f"the ring cuts each rank's block in two chunks: its length "
                         f"({q.shape[-2]}) must be even")
    return _RingAttention.apply(q, k, v, bool(causal), layout, group, stats)


def ring_messages(world_size: int, backward: bool = False) -> int:
    """Messages one rank sends per ring attention: N-1 forward, 2N-1 more in backward."""
    n = world_size
    return (n - 1) + ((n - 1) + n if backward else 0)


def ring_bytes(heads: int, seq: int, head_dim: int, world_size: int, backward: bool = False,
               itemsize: int = 4) -> int:
    """Payload bytes one rank sends in ring attention over S = ``seq`` tokens: forward, N-1 K/V
    blocks, ``2 (N-1)/N · S·H·D·itemsize``; backward adds N-1 K/V blocks and N dK/dV blocks."""
    n = world_size
    block = heads * (seq // n) * head_dim * itemsize
    return 2 * block * (n - 1) + (2 * block * ((n - 1) + n) if backward else 0)


# ------------------------------------------------------------------ Ulysses
@reference
def ulysses_attention(q, k, v, causal: bool = False, group=None):
    """This rank's block of attention output, by DeepSpeed-Ulysses (inside a rank).

    ``q``, ``k``, ``v``: ``[H, B, D]``, block r of the sequence (contiguous) on rank r. One
    all-to-all each gives every rank H/N whole heads over the whole sequence, :func:`attention_lse`
    runs there, one all-to-all brings the output back to ``[H, B, D]``. Differentiable (the
    all-to-all's backward is the reverse all-to-all). Raises ``ValueError`` when H is not a
    multiple of N: a rank gets whole heads, so Ulysses cannot use more ranks than heads.
    """
    n = dist.get_world_size(group)
    heads, block, dim = q.shape
    if heads % n:
        raise ValueError(f"Ulysses gives each rank whole heads: {heads} heads cannot be split "
                         f"over {n} ranks ({heads} % {n} = {heads % n}). It needs the number of "
                         f"heads to be a multiple of the number of ranks, so it can never use "
                         f"more ranks than there are heads; the ring has no such limit")
    h = heads // n
    # q, k and v in one all-to-all: one exchange of three blocks instead of three of one (fewer
    # messages: each all-to-all costs N - 1 of them, framing included)
    qkv = torch.stack([q.float(), k.float(), v.float()]).reshape(3, n, h, block, dim)
    ones = [1] * n                                  # piece i (of dim 0) to rank i, and back
    y = all_to_all(qkv.transpose(0, 1), ones, ones, group)   # y[i]: rank i's q, k, v block
    qh, kh, vh = y.permute(1, 2, 0, 3, 4).reshape(3, h, n * block, dim)   # my heads, all of S
    out, _ = attention_lse(qh, kh, vh, causal=causal)
    back = out.reshape(h, n, block, dim).transpose(0, 1)                  # piece i: block i
    return all_to_all(back, ones, ones, group).reshape(heads, block, dim)


def ulysses_bytes(heads: int, seq: int, head_dim: int, world_size: int, backward: bool = False,
                  itemsize: int = 4) -> int:
    """Payload bytes one rank sends in Ulysses attention: forward, one all-to-all of q, k and v
    (three blocks) to heads and one of the output (one block) back, each keeping 1/N at home:
    ``4 (N-1)/N · block = 4 (N-1)/N² · S·H·D·itemsize``; backward, the same two in reverse."""
    n = world_size
    block = heads * (seq // n) * head_dim * itemsize
    return 4 * block * (n - 1) // n * (2 if backward else 1)


# ------------------------------------------------------------------ measuring a run
def _inputs(heads, seq, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, seq, head_dim, generator=g) for _ in range(3)]


def measure_job(rank: int, world_size: int, heads: int = 4, seq: int = 64, head_dim: int = 16,
                causal: bool = True, backward: bool = True, methods=("ring", "balanced",
                                                                    "ulysses")) -> dict:
    """Inside every rank: each method against the one-process oracle (forward and, with
    ``backward``, dq/dk/dv), with the bytes this rank's gloo sockets sent and the chunk pairs
    it computed. Returns ``{method: {"out_err", "grad_err", "sent_fwd", "sent_bwd", "pairs",
    "compute_s"}}``. The same seed on every rank: the whole sequence is known everywhere, each
    rank keeps its rows."""
    from ..grading.watch import Watch
    watch = Watch()
    q, k, v = _inputs(heads, seq, head_dim)
    want = {}
    for t in (q, k, v):
        t.requires_grad_(True)
    ref, _ = attention_lse(q, k, v, causal=causal)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(g)
    want = [t.grad.detach().clone() for t in (q, k, v)]
    rows = {}
    for method in methods:
        layout = "balanced" if method == "balanced" else "contiguous"
        mine = [shard_sequence(t.detach(), rank, world_size, layout).requires_grad_(True)
                for t in (q, k, v)]
        stats: dict = {}
        watch.start()
        if method == "ulysses":
            out = ulysses_attention(*mine, causal=causal)
        else:
            out = ring_attention(*mine, causal=causal, layout=layout, stats=stats)
        fwd = watch.stop()
        row = {"out_err": float((out - shard_sequence(ref.detach(), rank, world_size, layout))
                                .abs().max()),
               "sent_fwd": fwd["sent"], "collectives_fwd": fwd["collectives"],
               "unwatched": fwd["error"], "pairs": stats.get("pairs"),
               "compute_s": stats.get("compute_s"), "steps": stats.get("steps")}
        if backward:
            watch.start()
            out.backward(shard_sequence(g, rank, world_size, layout))
            bwd = watch.stop()
            row["sent_bwd"] = bwd["sent"]
            row["grad_err"] = max(float((t.grad - shard_sequence(w, rank, world_size, layout))
                                        .abs().max()) for t, w in zip(mine, want))
        rows[method] = row
    dist.barrier()
    return rows


def imbalance_job(rank: int, world_size: int, heads: int = 4, seq: int = 1024,
                  head_dim: int = 32, repeats: int = 5) -> dict:
    """Inside every rank: causal ring attention forward in both layouts; per layout the chunk
    pairs this rank computed, its compute time (the least of ``repeats``, the run least
    disturbed; ``compute_s`` is the CPU time of the rank's thread, which ranks sharing cores do
    not inflate, ``wall_s`` the wall clock) and the last run's per-step times
    (:func:`ring_spans` draws them)."""
    q, k, v = _inputs(heads, seq, head_dim)
    out = {}
    for layout in LAYOUTS:
        mine = [shard_sequence(t, rank, world_size, layout) for t in (q, k, v)]
        runs = []
        for _ in range(repeats):
            stats: dict = {}
            dist.barrier()
            with torch.no_grad():
                ring_attention(*mine, causal=True, layout=layout, stats=stats)
            runs.append(stats)
        out[layout] = {"pairs": runs[-1]["pairs"], "scores": runs[-1]["scores"],
                       "compute_s": min(r["compute_cpu_s"] for r in runs),
                       "wall_s": min(r["compute_s"] for r in runs),
                       "steps": runs[-1]["steps"]}
    return out


def ring_spans(per_rank_steps: list) -> list:
    """Timeline spans (``lk.plots.timeline``'s format) of one ring per rank: each step's
    compute, and beside it the transfer of the next block, from posted to waited for."""
    t0 = min(st["compute"][0] if st["posted"] is None else min(st["posted"], st["compute"][0])
             for steps in per_rank_steps for st in steps)
    lanes = []
    for steps in per_rank_steps:
        spans = []
        for st in steps:
            a, b = st["compute"]
            spans.append({"lane": "compute", "kind": "forward", "label": f"block {st['block']}",
                          "start": a - t0, "end": b - t0})
            if st["posted"] is not None:
                spans.append({"lane": "comm", "kind": "send",
                              "label": "next K/V: posted … waited",
                              "start": st["posted"] - t0, "end": st["waited"][1] - t0})
        lanes.append(spans)
    return lanes


def plot_ring(world_size: int = 4, causal: bool = True, layout: str = "contiguous", ax=None):
    """Which K/V block each rank holds at each step of the ring (rank r holds rank (r - s) mod
    N's at step s), coloured by block; a causal pair with nothing to compute is greyed out.
    Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    n = world_size
    fig, ax = (plt.subplots(figsize=(1.2 + 1.1 * n, 1.2 + 0.55 * n)) if ax is None
               else (ax.figure, ax))
    colors = plt.get_cmap("tab10")
    for r in range(n):
        for s in range(n):
            j = (r - s) % n
            work = sum(pair_kind(a, b, causal) is not None for a in rank_chunks(r, n, layout)
                       for b in rank_chunks(j, n, layout))
            face = colors(j % 10) if work else "#E6E6E6"
            ax.add_patch(Rectangle((s, n - 1 - r), 0.92, 0.86, color=face,
                                   alpha=0.85 if work else 1.0))
            ax.text(s + 0.46, n - 1 - r + 0.43, f"K/V {j}\n{work}/4" if causal else f"K/V {j}",
                    ha="center", va="center", fontsize=8, color="black" if work else "#888888")
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([s + 0.46 for s in range(n)], [f"step {s}" for s in range(n)])
    ax.set_yticks([n - 1 - r + 0.43 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    what = (f"causal, {layout}: chunk pairs computed, of 4 (grey: none)" if causal
            else "not causal: every block is computed")
    ax.set_title(f"ring attention, {n} ranks: the K/V block each rank holds\n(each step every "
                 f"block moves on to rank r + 1 mod {n})\n{what}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_work(per_layout: dict, title: str = ""):
    """Bars per rank: chunk pairs computed (left) and compute ms (right), one colour per
    layout. ``per_layout``: ``{layout: [{"pairs", "compute_s"} per rank]}``."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    layouts = list(per_layout)
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        rows = per_layout[layout]
        xs = [r + (i - (len(layouts) - 1) / 2) * width for r in range(len(rows))]
        axes[0].bar(xs, [row["pairs"] for row in rows], width, label=layout)
        axes[1].bar(xs, [1000 * row["compute_s"] for row in rows], width, label=layout)
    for ax, what in zip(axes, ("chunk pairs computed (counted)",
                               "compute, CPU ms of the rank's thread (measured)")):
        ax.set_xticks(range(len(per_layout[layouts[0]])),
                      [f"rank {r}" for r in range(len(per_layout[layouts[0]]))])
        ax.set_title(what, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _timed_job(rank, world_size, heads, seq, head_dim, causal, repeats):
    """Inside every rank: median forward+backward time of each method (slowest rank decides:
    every rank reports, the caller takes the max), bytes sent per forward+backward."""
    from ..grading.watch import Watch
    watch = Watch()
    q, k, v = _inputs(heads, seq, head_dim)
    g = torch.randn(heads, seq, head_dim, generator=torch.Generator().manual_seed(1))
    times, sent = {}, {}
    one = []
    for _ in range(repeats):                        # one process, the whole sequence: rank 0
        dist.barrier()
        if rank == 0:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            t0 = time.perf_counter()
            out, _ = attention_lse(qq, kk, vv, causal=causal)
            out.backward(g)
            one.append(time.perf_counter() - t0)
    times["one process"] = statistics.median(one) if one else None
    sent["one process"] = 0
    for method in ("ring", "balanced", "ulysses"):
        layout = "balanced" if method == "balanced" else "contiguous"
        mine = [shard_sequence(t, rank, world_size, layout) for t in (q, k, v)]
        gm = shard_sequence(g, rank, world_size, layout)
        spans = []
        for i in range(repeats + 1):
            xs = [t.clone().requires_grad_(True) for t in mine]
            dist.barrier()
            watch.start()
            t0 = time.perf_counter()
            if method == "ulysses":
                out = ulysses_attention(*xs, causal=causal)
            else:
                out = ring_attention(*xs, causal=causal, layout=layout)
            out.backward(gm)
            dt = time.perf_counter() - t0
            seen = watch.stop()
            if i:                                    # the first is a warm-up
                spans.append(dt)
                sent[method] = seen["sent"]
        times[method] = statistics.median(spans)
    return {"times": times, "sent": sent}


def bench_rows(world_sizes=(2, 4), heads: int = 8, seq: int = 1024, head_dim: int = 64,
               causal: bool = True, repeats: int = 5) -> list[dict]:
    """Rows for ``python -m labkit bench sequences``: per world size and method (one process,
    ring contiguous, ring balanced, Ulysses), the median forward+backward time of the slowest
    rank (ms), the bytes rank 0 sent (gloo's socket counters) and the formula's payload."""
    from ..runtime import run
    rows = []
    for n in world_sizes:
        res = run(_timed_job, n, args=(heads, seq, head_dim, causal, repeats), timeout=300,
                  deadline=1200, echo=False).values
        for method in ("one process", "ring", "balanced", "ulysses"):
            ms = [r["times"][method] for r in res if r["times"][method] is not None]
            formula = {"one process": 0,
                       "ring": ring_bytes(heads, seq, head_dim, n, backward=True),
                       "balanced": ring_bytes(heads, seq, head_dim, n, backward=True),
                       "ulysses": ulysses_bytes(heads, seq, head_dim, n, backward=True)}[method]
            rows.append({"world_size": n, "method": {"ring": "ring (contiguous)",
                                                      "balanced": "ring (load-balanced)",
                                                      "ulysses": "Ulysses"}.get(method, method),
                         "ms": 1000 * max(ms), "sent": res[0]["sent"][method],
                         "formula": formula, "heads": heads, "seq": seq, "head_dim": head_dim,
                         "causal": causal})
    return rows


def bench_table(rows: list[dict]) -> str:
    """A Markdown table of :func:`bench_rows`."""
    out = ["| ranks | method | fwd+bwd ms (slowest rank) | rank 0 sent (B) | formula (B) |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['world_size']} | {r['method']} | {r['ms']:.1f} | {r['sent']:,} | "
                   f"{r['formula']:,} |")
    return "\n".join(out)
