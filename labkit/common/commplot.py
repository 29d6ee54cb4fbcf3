"""The per-rank timeline of a traced job: every collective, every wait, every straggler (notebook 07).

Drawn from a :class:`labkit.runtime.commtrace.CommTrace` (``lk.run(..., trace=True).trace``),
in the spirit of Horovod's timeline: one row per rank with each operation from the moment the
rank issued it to the moment it completed, coloured by kind, and below it the time the rank
waited: blocked in ``wait()``, or with a collective issued before its group's last rank. Collectives are matched across ranks by group and order;
a triangle marks the rank that arrived last at each one (everyone else waited for it), and the
worst straggler is named in the title. ``compute=`` adds per-rank spans measured with
:class:`labkit.common.timeline.Timeline` (forward, backward ...) on the same time axis.

``lk.plots.comm_timeline(res.trace)`` is this function.
"""
from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt

__all__ = ["comm_timeline", "COMM_COLORS"]

# The kinds notebook 02's timelines share keep their colours (labkit.common.plots.KIND_COLORS).
COMM_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "all_reduce": "#55A868",
               "step": "#8172B3", "idle": "#D9D9D9", "broadcast": "#937860",
               "all_gather": "#2A9D8F", "reduce_scatter": "#E9C46A",
               "all_to_all": "#F4A261", "reduce": "#8AB17D", "gather": "#457B9D",
               "scatter": "#A8DADC", "barrier": "#6C757D", "send": "#C44E52",
               "recv": "#E07A7E", "data": "#64B5CD", "early": "#F4A261"}


def comm_timeline(trace, title: str = "", compute: Sequence[Sequence[dict]] | None = None,
                  ax=None, unit: str = "ms", min_skew: float = 0.0,
                  kinds: tuple[str, ...] | None = None) -> plt.Figure:
    """Draw every rank's collectives, waits and (optionally) compute on one time axis.

    Args:
        trace: a :class:`~labkit.runtime.commtrace.CommTrace` (``res.trace``).
        title: the figure's title (the worst straggler is appended).
        compute: per-rank spans in :mod:`labkit.common.timeline` format, in ``perf_counter``
            seconds as measured (not aligned); drawn in a ``compute`` row per rank.
        unit: ``"ms"`` or ``"s"``.
        min_skew: mark a straggler only when it arrived at least this many seconds late.
        kinds: draw only these kinds of operation (e.g. ``("all_reduce",)``); default all.

    The ``wait`` row shows two things: hatched grey, time blocked inside a Python ``wait()``;
    hatched orange, time a collective was already issued while the group's last rank had not
    issued it yet (waiting for the straggler, whoever waits: Python or PyTorch's C++).
    Returns a matplotlib Figure.
    """
    scale = {"ms": 1e3, "s": 1.0}[unit]
    n = len(trace)
    shown = [[r for r in recs if kinds is None or r["kind"] in kinds] for recs in trace]
    starts = [r["start"] for recs in shown for r in recs]
    starts += [s["start"] for spans in (compute or []) for s in spans]
    t0 = min(starts) if starts else 0.0
    lanes = (["compute"] if compute else []) + ["comm", "wait"]
    rows = [(r, lane) for r in range(n) for lane in lanes]
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.4), layout="constrained")
    fig = ax.figure
    seen: set[str] = set()
    y_of = {(r, lane): y for y, (r, lane) in enumerate(rows)}
    for rank in range(n):
        for s in (compute[rank] if compute else []):
            _bar(ax, y_of[(rank, "compute")], s["start"] - t0, s["end"] - t0, s["kind"],
                 scale, seen)
        for rec in shown[rank]:
            end = rec["end"] if rec["end"] is not None else rec["start"]
            _bar(ax, y_of[(rank, "comm")], rec["start"] - t0, end - t0, rec["kind"], scale,
                 seen, alpha=0.85)
            if rec["wait_start"] is not None:
                _bar(ax, y_of[(rank, "wait")], rec["wait_start"] - t0, rec["wait_end"] - t0,
                     "idle", scale, seen, label="blocked in wait()")
    worst = None
    for m in trace.matched(kinds):
        if len(m["arrivals"]) < 2 or m["skew"] <= min_skew:
            continue
        last = m["arrivals"][m["last"]]
        for rank, arrived in m["arrivals"].items():
            if rank != m["last"]:
                _bar(ax, y_of[(rank, "wait")], arrived - t0, last - t0, "early", scale, seen,
                     label="issued, waiting for the last rank")
        ax.plot([(last - t0) * scale], [y_of[(m["last"], "comm")] - 0.42], marker="v",
                color="black", ms=4)
        if worst is None or m["skew"] > worst["skew"]:
            worst = m
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}), measured in each rank")
    if worst is not None:
        title = (f"{title}\n" if title else "") + (
            f"▼ = last rank to arrive; worst: rank {worst['last']} reached {worst['kind']} "
            f"{worst['skew'] * scale:.1f} {unit} after the first rank")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _bar(ax, y: int, start: float, end: float, kind: str, scale: float, seen: set,
         alpha: float = 1.0, label: str | None = None) -> None:
    width = max(end - start, 0.0) * scale
    name = label or kind
    ax.barh(y, width, left=start * scale, height=0.7, color=COMM_COLORS.get(kind, "#999999"),
            alpha=alpha, edgecolor="white", lw=0.3,
            hatch="//" if kind in ("idle", "early") else None,
            label=None if name in seen else name)
    seen.add(name)
