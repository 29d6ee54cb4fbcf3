"""Pictures of distributed training, drawn from what real ranks measured.

* :func:`gradient_inspector` — each rank's local gradient, the all-reduced
  one, and the single-process oracle side by side (notebook 02, step 5).
* :func:`timeline` — per-rank lanes of compute and communication spans
  (:mod:`labkit.common.timeline` format), e.g. the pipeline bubble (notebook 01) or
  all-reduces overlapping backward (notebook 02).
* :func:`replica_drift`, :func:`checksums`, :func:`shards`, :func:`per_rank` —
  replicas drifting apart or staying identical; what ``DistributedSampler``
  gives each rank; one value per rank.
* :func:`bucket_explorer` — a bucket-size slider over recorded timelines
  (a static grid when no widget front-end can show it, e.g. under nbval).
* :func:`comm_timeline` — every collective and wait of a traced job
  (``lk.run(..., trace=True)``), per rank, stragglers marked (notebook 07;
  drawn by :mod:`labkit.common.commplot`).

Every function returns a matplotlib ``Figure`` (or a widget); in a notebook
end the line with ``;`` or assign it so it is shown once.

Example::

    lk.plots.timeline(pipe["spans"], title="2-stage pipeline, 1 micro-batch");
"""
from __future__ import annotations

import io
import os
from typing import Sequence

import matplotlib.pyplot as plt
import torch

from .commplot import comm_timeline

__all__ = ["KIND_COLORS", "rank_color", "timeline", "gradient_inspector", "per_rank",
           "replica_drift", "checksums", "shards", "bucket_explorer", "bucket_grid",
           "comm_timeline"]

KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "all_reduce": "#55A868",
               "step": "#8172B3", "idle": "#D9D9D9", "send": "#C44E52", "recv": "#C44E52",
               "broadcast": "#937860", "data": "#64B5CD", "all_gather": "#2A9D8F",
               "reduce_scatter": "#E76F51"}


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every picture of the lab."""
    return plt.get_cmap("tab10")(rank % 10)


def timeline(per_rank: Sequence[Sequence[dict]], title: str = "", ax=None,
             unit: str = "ms") -> plt.Figure:
    """Draw each rank's spans on its own row (a second row per rank for the ``comm`` lane).

    ``per_rank[r]`` is rank r's list of span dicts (``lane``, ``kind``, ``label``,
    ``start``, ``end`` in seconds). ``"grads ready"`` spans of zero length are drawn
    as tick marks. Gaps are time the rank spent on nothing we measured.
    """
    scale = {"ms": 1e3, "s": 1.0}[unit]
    rows = []
    for r, spans in enumerate(per_rank):
        lanes = sorted({s["lane"] for s in spans}, key=lambda lane: lane != "compute")
        rows += [(r, lane) for lane in lanes or ["compute"]]
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.2), layout="constrained")
    fig = ax.figure
    seen = set()
    for y, (r, lane) in enumerate(rows):
        for s in per_rank[r]:
            if s["lane"] != lane:
                continue
            x0, w = s["start"] * scale, (s["end"] - s["start"]) * scale
            if w == 0:
                ax.plot([x0, x0], [y - 0.35, y + 0.35], color="black", lw=1)
                continue
            kind = s["kind"]
            ax.barh(y, w, left=x0, height=0.7, color=KIND_COLORS.get(kind, "#999999"),
                    edgecolor="white", lw=0.5, hatch="//" if kind == "idle" else None,
                    label=None if kind in seen else kind)
            seen.add(kind)
            if s.get("label") and w > 0.04 * _span_width(per_rank) * scale:
                ax.text(x0 + w / 2, y, s["label"], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + ("" if lane == "compute" else f" {lane}")
                        for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}), measured in each rank")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def _span_width(per_rank) -> float:
    ends = [s["end"] for spans in per_rank for s in spans]
    starts = [s["start"] for spans in per_rank for s in spans]
    return (max(ends) - min(starts)) if ends else 1.0


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float().cpu()
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(t.shape[0], -1)


def gradient_inspector(local: Sequence[torch.Tensor],
                       averaged: Sequence[torch.Tensor] | None = None,
                       oracle: torch.Tensor | None = None, losses: Sequence[float] | None = None,
                       name: str = "gradient") -> plt.Figure:
    """Each rank's local gradient, the all-reduced gradient per rank, and the oracle, side by side.

    Args:
        local: rank r's gradient right after its own ``backward()`` (before any sync).
        averaged: rank r's gradient after the all-reduce (they should all be equal);
            omit it (and ``oracle``) to show the local gradients only.
        oracle: the gradient of one process that saw the whole batch.
        losses: rank r's loss, shown in its title.
    """
    n = len(local)
    mats = [_as_2d(g) for g in local]
    extra = []
    if averaged is not None:
        same = all(torch.equal(_as_2d(a), _as_2d(averaged[0])) for a in averaged)
        extra.append(("after all_reduce\n" + (f"(same on all {n} ranks)" if same
                                               else "(DIFFERS by rank)"), _as_2d(averaged[0])))
    if oracle is not None:
        extra.append(("oracle: 1 process,\nwhole batch", _as_2d(oracle)))
    allm = mats + [m for _, m in extra]
    vmax = max(float(m.abs().max()) for m in allm) or 1.0
    fig, axes = plt.subplots(1, len(allm), figsize=(1.9 * len(allm) + 1, 3.0), squeeze=False,
                             layout="constrained")
    for i, (ax, m) in enumerate(zip(axes[0], allm)):
        im = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
        ax.set_xticks([])
        ax.set_yticks([])
        if i < n:
            title = f"rank {i} local" + (f"\nloss {losses[i]:.3g}" if losses is not None else "")
            for side in ax.spines.values():
                side.set_edgecolor(rank_color(i))
                side.set_linewidth(3)
        else:
            title = extra[i - n][0]
        ax.set_title(title, fontsize=9)
    parts = []
    if averaged is not None:
        mean_local = float((torch.stack(mats).mean(0) - _as_2d(averaged[0])).abs().max())
        parts.append(f"max |mean of locals − all-reduced| = {mean_local:.2e}")
    if averaged is not None and oracle is not None:
        diff = float((_as_2d(averaged[0]) - _as_2d(oracle)).abs().max())
        parts.insert(0, f"max |all-reduced − oracle| = {diff:.2e}")
    fig.suptitle(f"{name}" + (": " + ";  ".join(parts) if parts else ""), fontsize=10)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.9)
    return fig


def per_rank(values: Sequence[float], title: str = "", ylabel: str = "") -> plt.Figure:
    """One bar per rank, in the rank's colour, with the value written on it."""
    fig, ax = plt.subplots(figsize=(5, 2.6), layout="constrained")
    bars = ax.bar([f"rank {r}" for r in range(len(values))], values,
                  color=[rank_color(r) for r in range(len(values))])
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    return fig


def replica_drift(independent: dict, data_parallel: dict) -> plt.Figure:
    """Checksums per rank over training steps, and the largest distance between two replicas.

    Both arguments are results of :func:`labkit.data_vs_model.replica_drift`.
    """
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    for r, sums in enumerate(independent["checksums"]):
        a.plot(sums, color=rank_color(r), label=f"rank {r}, alone")
    for r, sums in enumerate(data_parallel["checksums"]):
        a.plot(sums, color="black", ls="--", lw=1,
               label="all ranks, data parallel" if r == 0 else None)
    a.set(xlabel="step", ylabel="sum of all parameters", title="each replica's checksum")
    a.legend(fontsize=7)
    b.plot(independent["distance"], label="alone: no communication", color="#C44E52")
    b.plot(data_parallel["distance"], label="data parallel: gradients all-reduced", color="#55A868")
    b.set(xlabel="step", ylabel="max ‖θ_i − θ_j‖",
          title=f"distance between replicas (final: {independent['distance'][-1]:.3g} vs "
                f"{data_parallel['distance'][-1]:.3g})")
    b.legend(fontsize=8)
    return fig


def checksums(before: Sequence[float], after: Sequence[float],
              title: str = "parameter checksum per rank",
              labels: tuple[str, str] = ("before", "after")) -> plt.Figure:
    """Each rank's checksum in two situations (before/after a broadcast, without/with sync)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.8), sharey=True, layout="constrained")
    for ax, values, what in zip(axes, (before, after), labels):
        ax.bar([f"rank {r}" for r in range(len(values))], values,
               color=[rank_color(r) for r in range(len(values))])
        spread = max(values) - min(values)
        ax.set_title(f"{what}: spread {spread:.3g}", fontsize=10)
    fig.suptitle(title)
    return fig


def shards(indices: Sequence[Sequence[Sequence[int]]], dataset_size: int,
           epochs: Sequence[int] | None = None) -> plt.Figure:
    """Which rank gets which sample: ``indices[e][r]`` = rank r's indices in epoch e.

    One row per epoch, one cell per sample, coloured by the rank that gets it and
    numbered with its place in that rank's order. A sample handed out twice
    (``DistributedSampler`` pads so every rank gets as many) is split in two,
    one half per rank, and marked ×2.
    """
    fig, ax = plt.subplots(figsize=(min(12, 0.5 * dataset_size + 3), 0.6 * len(indices) + 1.4),
                           layout="constrained")
    for e, per_rank in enumerate(indices):
        owners: list[list[tuple[int, int]]] = [[] for _ in range(dataset_size)]
        for r, idx in enumerate(per_rank):
            for pos, i in enumerate(idx):
                owners[i].append((r, pos))
        for i, own in enumerate(owners):
            h = 0.9 / max(1, len(own))
            for k, (r, pos) in enumerate(own):
                ax.add_patch(plt.Rectangle((i, e + k * h), 1, h, fc=rank_color(r), ec="white"))
                ax.text(i + 0.5, e + (k + 0.5) * h, f"{pos}", ha="center", va="center",
                        fontsize=7, color="white")
            if len(own) > 1:
                ax.text(i + 0.97, e + 0.02, f"×{len(own)}", ha="right", va="top", fontsize=7)
    ax.set_xlim(0, dataset_size)
    ax.set_xticks([i + 0.5 for i in range(dataset_size)], [str(i) for i in range(dataset_size)])
    ax.set_ylim(len(indices), 0)
    ax.set_yticks([e + 0.45 for e in range(len(indices))])
    ax.set_yticklabels([f"epoch {e}" for e in (epochs or range(len(indices)))])
    ax.set_xlabel("sample index\n(colour: the rank that gets it; number: its place in that "
                  "rank's order)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_color(r)) for r in range(len(indices[0]))]
    ax.legend(handles, [f"rank {r}" for r in range(len(indices[0]))], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    return fig


def bucket_grid(runs: dict[float, Sequence[Sequence[dict]]]) -> plt.Figure:
    """All recorded bucket sizes at once: one timeline per ``bucket_cap_mb``, same time axis."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.1 * len(runs)), sharex=True,
                             layout="constrained")
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (cap, per_rank) in zip(axes, runs.items()):
        timeline(per_rank, title=_cap_title(cap, per_rank), ax=ax)
    return fig


def _cap_title(cap: float, per_rank) -> str:
    n = sum(1 for s in per_rank[0] if s["kind"] == "all_reduce")
    return f"bucket_cap_mb = {cap:g}: {n} all-reduce{'s' * (n != 1)} per step"


def _frontend_can_show_widgets() -> bool:
    # nbval (and other headless runs) inherit PYTEST_CURRENT_TEST; nobody can move a slider there
    return "PYTEST_CURRENT_TEST" not in os.environ and os.environ.get("LABKIT_STATIC") != "1"


def bucket_explorer(runs: dict[float, Sequence[Sequence[dict]]], static: bool | None = None):
    """A slider over ``bucket_cap_mb`` showing the timeline recorded for each value.

    ``runs`` maps a bucket cap to per-rank spans. The timelines are rendered to
    PNG once, so moving the slider only swaps images (no Output widget, nothing
    re-run). Without a widget front-end (``static=True``, or under nbval) it
    returns :func:`bucket_grid` instead.
    """
    if static is None:
        static = not _frontend_can_show_widgets()
    if static:
        fig = bucket_grid(runs)
        plt.close(fig)   # shown once, as the cell's value, not again by pyplot at the cell's end
        return fig
    import ipywidgets as widgets

    images = {}
    for cap, per_rank in runs.items():
        fig = timeline(per_rank, title=_cap_title(cap, per_rank))
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        images[cap] = buf.getvalue()
    caps = list(runs)
    slider = widgets.SelectionSlider(options=[(f"{c:g} MB", c) for c in caps], value=caps[0],
                                     description="bucket_cap_mb", continuous_update=True,
                                     layout=widgets.Layout(width="60%"))
    image = widgets.Image(value=images[caps[0]], format="png")
    slider.observe(lambda change: setattr(image, "value", images[change["new"]]), names="value")
    box = widgets.VBox([slider, image])
    box.slider, box.image, box.images = slider, image, images   # handles for tests
    return box
