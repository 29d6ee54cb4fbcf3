"""Which axis when (notebook 09 §12): what each way of splitting a transformer layer keeps and
sends per rank, from the formulas the lesson's runs checked.

Every number here comes from a formula owned by the module that measured it on real ranks:

* activations per layer: :func:`~labkit.sequences_experts.activations.korthikanti_bytes`
  (Korthikanti et al. 2022, 16-bit activations; §1 matched its fp32 form to the byte);
* tensor parallelism, with or without sequence parallelism: four ring halves or all-reduces of
  the layer's activation per direction (:func:`~labkit.sequences_experts.sequence_parallel.sent_formula`,
  matched in §3);
* ring attention and Ulysses: :func:`~labkit.sequences_experts.attention.ring_bytes` and
  :func:`~labkit.sequences_experts.attention.ulysses_bytes` (matched in §4–§6);
* expert parallelism: the two token all-to-alls of
  :func:`~labkit.sequences_experts.experts.a2a_bytes` for routing spread evenly (matched in §9).

For a model and a cluster the lab has not run these are **predictions**: payload bytes only
(no framing, no overlap, no kernel's workspace), activations of one layer for one sequence, a
fused (flash) attention kernel wherever the sequence is split (it keeps no s × s tensor; §1
measured that SDPA does not), routing spread evenly over the experts.
"""
from __future__ import annotations

from ..common.tables import Col, table
from .activations import korthikanti_bytes
from .attention import ring_bytes, ulysses_bytes
from .experts import a2a_bytes
from .sequence_parallel import sent_formula

__all__ = ["AXES", "plan", "plan_table"]

AXES = ("one rank", "TP", "TP+SP", "CP ring", "CP Ulysses", "EP")


def plan(s: int, h: int, a: int, n: int, b: int = 1, top_k: int = 2, experts: int = 64,
         itemsize: int = 2, attention: str = "flash") -> list[dict]:
    """One row per axis of :data:`AXES` on ``n`` ranks: a layer of hidden size ``h`` with ``a``
    heads over a sequence of ``s`` tokens (``b`` sequences), activations in ``itemsize`` bytes.

    Each row: ``kept`` (activation bytes one rank keeps for backward, one layer), ``sent``
    (payload bytes one rank sends per layer, forward + backward), ``limit`` (what caps the
    axis). EP's ``sent`` is per MoE layer, ``experts`` experts, ``top_k`` per token, spread
    evenly (each rank sends ``top_k·s·b/n`` rows to every rank); its ``kept`` is the rest of the
    layer's, which EP does not split. ``attention``: ``"flash"`` (a fused kernel
    everywhere: no s × s term) or ``"materialised"`` (the paper's 5as/h term where the whole
    sequence's scores are on one rank: one rank, TP, TP+SP, EP; ring attention and Ulysses keep
    the flash form either way)."""
    if n < 2:
        raise ValueError(f"n={n}: plan compares ways of splitting over 2 or more ranks.")
    if attention not in ("flash", "materialised"):
        raise ValueError(f"attention={attention!r}: choose 'flash' or 'materialised'.")
    heads = a if attention == "materialised" else 0          # a = 0 drops the 5as/h term
    act = s * b * h * itemsize                     # one activation tensor [s, b, h]
    halves = sent_formula("tp", s, b, h, n, framing=0)["halves"]      # 8: 4 all-reduces
    ring_half = (n - 1) * act // n
    rows = top_k * s * b // n                      # EP: rows one rank sends to each rank
    out = [
        {"axis": "one rank", "kept": korthikanti_bytes(s, b, h, heads), "sent": 0,
         "limit": "the whole layer on one GPU"},
        {"axis": "TP", "kept": korthikanti_bytes(s, b, h, heads, t=n), "sent": halves * ring_half,
         "limit": f"heads and hidden divisible by {n}; all-reduces on the critical path: "
                  "inside a node (NVLink)"},
        {"axis": "TP+SP", "kept": korthikanti_bytes(s, b, h, heads, t=n, sp=True),
         "sent": halves * ring_half, "limit": "as TP, and s divisible by n"},
        {"axis": "CP ring", "kept": korthikanti_bytes(s / n, b, h, 0),
         "sent": b * ring_bytes(a, s, h // a, n, backward=True, itemsize=itemsize),
         "limit": "K/V transfer must hide under each block's attention compute"},
        {"axis": "CP Ulysses", "kept": korthikanti_bytes(s / n, b, h, 0),
         "sent": b * ulysses_bytes(a, s, h // a, n, backward=True, itemsize=itemsize),
         "limit": f"heads divisible by {n} (n ≤ heads)"},
        {"axis": "EP", "kept": korthikanti_bytes(s, b, h, heads),
         "sent": a2a_bytes([rows] * n, [rows] * n, 0, h, experts // n, itemsize, backward=True,
                           header=0)["payload"],
         "limit": f"experts divisible by {n}; a busy expert's rank is the straggler"},
    ]
    for r in out:
        r["kept_GiB"], r["sent_GiB"] = r["kept"] / 2 ** 30, r["sent"] / 2 ** 30
    return out


def plan_table(rows: list[dict]) -> str:
    """The rows of :func:`plan` as a text table (GiB per rank, one layer)."""
    return table([Col("axis", "axis", "<11"), Col("kept / layer", "kept_GiB", ">10.2f"),
                  Col("sent / layer", "sent_GiB", ">12.3f"), Col("limit", "limit", "<")], rows,
                 above=["GiB per rank, one layer, forward + backward (prediction)"])
