"""Timelines from real timings: what each rank was doing, and when.

Notebooks 01 and 02 draw per-rank timelines (compute, communication, idle
time) from spans measured inside the ranks. A span is a plain dict so it
pickles back to the notebook::

    {"rank": 0, "lane": "compute", "kind": "backward", "label": "", "start": 0.012, "end": 0.020}

Times come from ``time.perf_counter()``, which on Linux reads the system-wide
monotonic clock, so spans from different rank processes share one time axis.
:func:`align` shifts a job's spans so the earliest starts at 0.

Example (inside a rank)::

    tl = Timeline(rank)
    with tl.span("forward"):
        loss = model(x).mean()
    return tl.spans          # -> lk.plots.timeline([res.values...])
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Timeline", "align", "busy_seconds", "idle_fraction", "fastest_step", "now"]

now = time.perf_counter


class Timeline:
    """Spans recorded in one rank.

    Args:
        rank: stored in every span, so a flat list of spans still says whose they are.
        cuda_sync: call ``torch.cuda.synchronize()`` at span edges (GPU work is
            asynchronous: without it a CUDA span measures only the launch).
    """

    def __init__(self, rank: int, cuda_sync: bool = False) -> None:
        self.rank = rank
        self.cuda_sync = cuda_sync
        self.spans: list[dict] = []

    def _clock(self) -> float:
        if self.cuda_sync:
            import torch

            torch.cuda.synchronize()
        return now()

    @contextmanager
    def span(self, kind: str, lane: str = "compute", label: str = "") -> Iterator[None]:
        """Time the body of a ``with`` block as one span of ``kind`` on ``lane``."""
        start = self._clock()
        try:
            yield
        finally:
            self.add(kind, start, self._clock(), lane=lane, label=label)

    def add(self, kind: str, start: float, end: float, lane: str = "compute",
            label: str = "") -> None:
        """Record a span measured elsewhere (e.g. an async all-reduce's launch and finish)."""
        self.spans.append({"rank": self.rank, "lane": lane, "kind": kind, "label": label,
                           "start": float(start), "end": float(max(end, start))})


def align(per_rank: list[list[dict]]) -> list[list[dict]]:
    """Copies of every rank's spans with times shifted so the earliest span starts at 0."""
    starts = [s["start"] for spans in per_rank for s in spans]
    t0 = min(starts) if starts else 0.0
    return [[{**s, "start": s["start"] - t0, "end": s["end"] - t0} for s in spans]
            for spans in per_rank]


def fastest_step(per_rank_steps: list[list[list[dict]]]) -> list[list[dict]]:
    """Of several repeats of a step (``[rank][step] -> spans``), the one that took least time.

    A step lasts from the first rank's first start to the last rank's last end;
    on a shared machine the shortest repeat is the one least disturbed by other
    programs. Returns that step's spans for every rank (``[rank] -> spans``).
    """
    n = min(len(steps) for steps in per_rank_steps)

    def duration(i: int) -> float:
        spans = [s for steps in per_rank_steps for s in steps[i]]
        return max(s["end"] for s in spans) - min(s["start"] for s in spans) if spans else 0.0

    best = min(range(n), key=duration)
    return [steps[best] for steps in per_rank_steps]


def busy_seconds(spans: list[dict], kinds: tuple[str, ...] | None = None) -> float:
    """Total time covered by spans (overlaps counted once), optionally of some kinds only."""
    chosen = sorted((s["start"], s["end"]) for s in spans if kinds is None or s["kind"] in kinds)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in chosen:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def idle_fraction(spans: list[dict], idle_kinds: tuple[str, ...] = ("idle",),
                  window: tuple[float, float] | None = None) -> float:
    """Share of a rank's time window spent in ``idle_kinds`` spans (e.g. waiting in ``recv``).

    The window defaults to the rank's first start to its last end.
    """
    if not spans:
        return 0.0
    lo, hi = window or (min(s["start"] for s in spans), max(s["end"] for s in spans))
    if hi <= lo:
        return 0.0
    clipped = [{**s, "start": max(s["start"], lo), "end": min(s["end"], hi)} for s in spans
               if s["end"] > lo and s["start"] < hi]
    return busy_seconds(clipped, idle_kinds) / (hi - lo)
