"""Which axis when (notebook 09 §14): what each way of splitting a transformer layer keeps and
sends per rank, from the formulas the lesson's runs checked.

Every number here comes from a formula owned by the module that measured it on real ranks:

* activations per layer: :func:`~labkit.sequences_experts.activations.block_formula`
  (Korthikanti et al. 2022's count, term by term, for each layout; §1 and §3 matched it to the
  byte in fp32);
* tensor parallelism, with or without sequence parallelism: two all-reduces (four ring halves)
  of the layer's activation each way, eight halves a step; Megatron's sequence parallelism,
  which keeps only the input shard of each column-parallel linear and all-gathers it again in
  backward, two halves more (:func:`~labkit.sequences_experts.sequence_parallel.sent_formula`,
  matched in §3);
* ring attention and Ulysses: :func:`~labkit.sequences_experts.attention.ring_bytes` and
  :func:`~labkit.sequences_experts.attention.ulysses_bytes` (matched in §8);
* expert parallelism: the token all-to-alls of :func:`~labkit.sequences_experts.experts.a2a_bytes`
  (matched in §11), routing spread evenly.

For a model and a cluster the lab has not run these are **predictions**: payload bytes only
(no framing, no overlap, no kernel's workspace), activations of one layer, a fused (flash)
attention kernel unless ``attention="materialised"`` (it keeps no s × s tensor; §1 measured
that SDPA does not), one K/V head per query head (grouped-query attention makes the K/V that
ring attention and Ulysses move smaller).
"""
from __future__ import annotations

from ..common.tables import Col, table
from .activations import block_formula
from .attention import ring_bytes, ulysses_bytes
from .experts import a2a_bytes
from .sequence_parallel import sent_formula

__all__ = ["AXES", "plan", "plan_table"]

AXES = ("one rank", "TP", "TP+SP", "TP+SP regather", "CP ring", "CP Ulysses", "EP")


def plan(s: int, h: int, a: int, n: int, b: int = 1, top_k: int = 2, experts: int = 64,
         itemsize: int = 2, attention: str = "flash") -> list[dict]:
    """One row per axis of :data:`AXES` on ``n`` ranks: a layer of hidden size ``h`` with ``a``
    heads over ``b`` sequences of ``s`` tokens, activations in ``itemsize`` bytes (1-byte
    dropout masks, LayerNorm statistics left out, as the paper counts).

    Each row: ``kept`` (activation bytes one rank keeps for backward, one layer), ``sent``
    (payload bytes one rank sends for the layer, forward + backward), ``limit`` (what caps the
    axis). ``attention``: ``"flash"`` (a fused kernel: no s × s term) or ``"materialised"``
    (the paper's as²b terms wherever a rank holds a whole sequence's scores: one rank, TP, TP+SP;
    ring attention and Ulysses keep the flash form either way).

    EP splits the experts, not the tokens: its row is the MoE layer with each rank holding
    ``s/n`` of the tokens (EP runs over ranks that already split the data or the sequence),
    ``experts`` experts, ``top_k`` per token, routing spread evenly; ``kept`` counts the layer as
    dense (a top-k MoE keeps its MLP's inputs and hidden activations once per assignment, k
    times a dense MLP's)."""
    if n < 2:
        raise ValueError(f"n={n}: plan compares ways of splitting over 2 or more ranks.")
    if attention not in ("flash", "materialised"):
        raise ValueError(f"attention={attention!r}: choose 'flash' or 'materialised'.")
    heads = a if attention == "materialised" else 0          # a = 0 drops the as²b terms

    def kept(layout: str, tokens: float = s, ranks: int = n) -> float:
        return sum(block_formula(tokens, b, h, heads if tokens == s else 0, ranks, layout,
                                 e=itemsize, m=1, stats=False).values())

    ring_half = (n - 1) * (s * b * h * itemsize) // n
    tp_halves = sent_formula("tp", s, b, h, n)["halves"]                       # 8
    regather_halves = sent_formula("tp+sp", s, b, h, n, regather=True)["halves"]   # 10
    rows = top_k * (s // n) * b // n               # EP: rows one rank sends to each rank
    out = [
        {"axis": "one rank", "kept": kept("one process", ranks=1), "sent": 0,
         "limit": "the whole layer on one GPU"},
        {"axis": "TP", "kept": kept("tp"), "sent": tp_halves * ring_half,
         "limit": f"heads and hidden divisible by {n}; all-reduces on the critical path: "
                  "inside a node (NVLink)"},
        {"axis": "TP+SP", "kept": kept("tp+sp"), "sent": tp_halves * ring_half,
         "limit": f"as TP, and s divisible by {n}"},
        {"axis": "TP+SP regather", "kept": kept("tp+sp regather"),
         "sent": regather_halves * ring_half,
         "limit": "as TP+SP; the regather can overlap the input-gradient GEMM"},
        {"axis": "CP ring", "kept": kept("one process", tokens=s / n, ranks=1),
         "sent": b * ring_bytes(a, s, h // a, n, backward=True, itemsize=itemsize),
         "limit": "a block long enough that its attention hides its K/V transfer"},
        {"axis": "CP Ulysses", "kept": kept("one process", tokens=s / n, ranks=1),
         "sent": b * ulysses_bytes(a, s, h // a, n, backward=True, itemsize=itemsize),
         "limit": f"(K/V) heads divisible by {n}"},
        {"axis": "EP", "kept": kept("one process", tokens=s / n, ranks=1),
         "sent": a2a_bytes([rows] * n, [rows] * n, 0, h, experts // n, itemsize, backward=True,
                           header=0)["payload"],
         "limit": f"experts divisible by {n}; a busy expert's rank is the straggler"},
    ]
    for r in out:
        r["kept_GiB"], r["sent_GiB"] = r["kept"] / 2 ** 30, r["sent"] / 2 ** 30
    return out


def plan_table(rows: list[dict]) -> str:
    """The rows of :func:`plan` as a text table (GiB per rank, one layer)."""
    return table([Col("axis", "axis", "<14"), Col("kept / layer", "kept_GiB", ">12.3f"),
                  Col("sent / layer", "sent_GiB", ">12.3f"), Col("limit", "limit", "<")], rows,
                 above=["GiB per rank, one layer, forward + backward (prediction)"])
