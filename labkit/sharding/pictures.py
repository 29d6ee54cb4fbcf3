"""The pictures of notebook 06, drawn from what real ranks measured (and one labelled diagram).

* :func:`zero_diagram` — who holds what under DDP and ZeRO-1/2/3: a *diagram* of the formulas
  (§2), not a measurement, and titled so.
* :func:`memory_bars` — bytes per rank by part, measured from storages, with the formula's
  total marked (§1, §4, §8).
* :func:`traffic_bars` — bytes sent per rank per step, counted, against DDP's 2Ψ and
  ZeRO-3's 3Ψ (§4, §8).
* :func:`step_timelines` — one FSDP2 step above one DDP step, from ``torch.profiler`` (§9).
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..common.plots import timeline

__all__ = ["zero_diagram", "memory_bars", "traffic_bars", "step_timelines", "PART_COLORS"]

PART_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#8172B3",
               "buckets": "#55A868"}
_SHARDED = {"DDP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("optimizer", "grads"),
            "ZeRO-3": ("optimizer", "grads", "params")}


def zero_diagram(world_size: int = 4) -> plt.Figure:
    """Diagram (not data): each rank's parameters (4Ψ), gradients (4Ψ) and Adam state (8Ψ)."""
    widths = {"params": 4, "grads": 4, "optimizer": 8}
    fig, axes = plt.subplots(1, 4, figsize=(12, 0.45 * world_size + 1.4), sharey=True,
                             layout="constrained")
    for ax, (setup, sharded) in zip(axes, _SHARDED.items()):
        total = 0.0
        for r in range(world_size):
            x = 0.0
            for part, w in widths.items():
                if part in sharded:
                    seg = w / world_size
                    ax.barh(r, w, left=x, color="white", edgecolor=PART_COLORS[part], lw=0.8)
                    ax.barh(r, seg, left=x + r * seg, color=PART_COLORS[part])
                    total += seg if r == 0 else 0
                else:
                    ax.barh(r, w, left=x, color=PART_COLORS[part], edgecolor="white")
                    total += w if r == 0 else 0
                x += w
        ax.set_title(f"{setup}: {total:g}Ψ bytes per rank", fontsize=10)
        ax.set_xticks([])
    axes[0].set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for p, c in PART_COLORS.items()
               if p != "buckets"]
    fig.legend(handles, ["parameters (4Ψ)", "gradients (4Ψ)", "Adam state (8Ψ)"],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"Diagram of the ZeRO formulas on {world_size} ranks, fp32 + Adam "
                 f"(filled = held by that rank)", fontsize=10)
    return fig


def memory_bars(rows: list[dict], title: str = "") -> plt.Figure:
    """Stacked bars of measured bytes by part; a black tick at each row's formula total.

    ``rows``: ``{"label", "memory": {part: bytes}, "formula": total bytes or None}``.
    """
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.3), layout="constrained")
    seen = set()
    for y, row in enumerate(rows):
        left = 0
        for part, color in PART_COLORS.items():
            value = row["memory"].get(part) or 0
            if value:
                ax.barh(y, value / 1e3, left=left / 1e3, color=color,
                        label=None if part in seen else part)
                seen.add(part)
                left += value
        ax.text(left / 1e3, y, f" {left / 1e3:.1f} kB", va="center", fontsize=8)
        if row.get("formula"):
            f = row["formula"] / 1e3
            ax.plot([f, f], [y - 0.42, y + 0.42], color="black", lw=2,
                    label=None if "formula" in seen else "formula (total)")
            seen.add("formula")
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kB held by rank 0, measured from tensor storages")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def traffic_bars(rows: list[dict], psi: int, world_size: int, title: str = "") -> plt.Figure:
    """Counted bytes sent per rank per step, with DDP's 2Ψ and ZeRO-3's 3Ψ (ring, fp32) marked.

    ``rows``: ``{"label", "ring_sent": bytes}`` (rank 0's count of one step).
    """
    unit = 4 * psi * (world_size - 1) / world_size          # Ψ fp32 elements over a ring
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.3), layout="constrained")
    for y, row in enumerate(rows):
        ax.barh(y, row["ring_sent"] / 1e3, color="#55A868")
        ax.text(row["ring_sent"] / 1e3, y, f" {row['ring_sent'] / unit:.2f}Ψ", va="center",
                fontsize=8)
    for k, style in ((2, "--"), (3, ":")):
        ax.axvline(k * unit / 1e3, color="black", ls=style, lw=1, label=f"{k}Ψ (formula)")
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"kB sent by rank 0 in one step, counted ({world_size} ranks; "
                  f"Ψ = {psi:,} fp32 elements, on a ring (N-1)/N of each)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def step_timelines(fsdp: list[list[dict]], ddp: list[list[dict]]) -> plt.Figure:
    """One traced FSDP2 step above one traced DDP step (per-rank lanes, each rank's own clock)."""
    rows = sum(2 for _ in fsdp) + sum(2 for _ in ddp)
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 0.45 * rows + 2.2), layout="constrained")
    timeline(fsdp, ax=a, title="FSDP2 fully_shard: all-gather before each layer's forward "
                               "and backward, reduce-scatter after its backward")
    timeline(ddp, ax=b, title="DDP (as in notebook 02): one all-reduce per bucket, "
                              "overlapping backward")
    return fig
