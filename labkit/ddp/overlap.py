"""Overlap and bucketing, measured: when does each rank compute, and when does it communicate?

:func:`measure_overlap` trains an MLP with :class:`labkit.ddp.bucketed.BucketedDDP`
for several ``bucket_cap_mb`` values in one job and records every rank's
timeline: forward and backward (lane ``compute``), each bucket's all-reduce
from launch to completion (lane ``comm``), the wait in
``finish_gradient_synchronization`` and the optimizer step. Small buckets
start communicating early (during backward) but pay a fixed cost per
all-reduce; one huge bucket cannot start until backward is over. Notebook 02
("Use it: overlap and bucket size, measured") shows the runs with
:func:`labkit.common.plots.bucket_explorer`.

Example::

    res = lk.overlap.measure_overlap(world_size=4, caps=(0, 1, 25))
    lk.plots.bucket_explorer(res["runs"])
    res["step_ms"]      # {cap: median step time per rank 0}
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..common.models import mlp
from ..common.progress import progress as progress_bar
from ..common.ranks import device
from ..common.timeline import Timeline, align, fastest_step
from ..runtime import run
from .bucketed import BucketedDDP

__all__ = ["measure_overlap", "fastest_cap", "DEFAULT_CAPS"]

DEFAULT_CAPS = (0.0, 1.0, 3.0, 25.0)


def _overlap_rank(rank: int, world_size: int, caps, width: int, depth: int, batch: int,
                  steps: int, seed: int) -> dict:
    dev = device()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch, width, generator=g).to(dev)
    y = torch.randn(batch, width, generator=g).to(dev)
    out = {"runs": {}, "step_ms": {}, "buckets": {}, "checksum": {}}
    for cap in caps:
        model = mlp(width, depth, seed).to(dev)
        times, per_step = [], []
        for _ in range(steps):
            dist.barrier()
            tl = Timeline(rank, cuda_sync=dev.type == "cuda")
            if not times:                       # one wrapper per cap, a fresh timeline per step
                ddp = BucketedDDP(model, bucket_cap_mb=cap, timeline=tl)
            ddp.timeline = tl
            model.zero_grad()
            with tl.span("forward"):
                loss = F.mse_loss(ddp(x), y)
            with tl.span("backward"):
                loss.backward()
            with tl.span("idle", label="wait"):
                ddp.finish_gradient_synchronization()
            with tl.span("step"), torch.no_grad():
                for p in model.parameters():
                    p.sub_(p.grad, alpha=1e-3)
            times.append((tl.spans[-1]["end"] - tl.spans[0]["start"]) * 1e3)
            per_step.append(tl.spans)
        out["runs"][cap] = per_step
        out["step_ms"][cap] = statistics.median(times[1:] or times)
        out["buckets"][cap] = len(ddp.buckets)
        out["checksum"][cap] = float(sum(p.double().sum() for p in model.parameters()))
        ddp.remove_hooks()                      # this model is done
    return out


def measure_overlap(world_size: int = 4, caps=DEFAULT_CAPS, width: int = 512, depth: int = 6,
                    batch: int = 128, steps: int = 4, seed: int = 0,
                    progress: bool = True) -> dict:
    """Time data-parallel steps for each ``bucket_cap_mb`` in ``caps`` on ``world_size`` ranks.

    Returns ``{"runs": {cap: [rank][span]}, "step_ms": {cap: [ms per rank]},
    "buckets": {cap: count}, "checksums_equal": bool, "model_mb": float}``. For
    each cap the timeline kept is the fastest of the ``steps`` repeats (the least
    disturbed by other programs), aligned to start at 0; ``step_ms`` is the median
    over the repeats after the first. ``checksums_equal`` says whether every rank
    ended with the same parameters for every cap (it must). One job per cap, with
    a progress bar when ``progress``.
    """
    out = {"runs": {}, "step_ms": {}, "buckets": {}, "checksums_equal": True,
           "model_mb": depth * (width * width + width) * 4 / 2**20}
    bar = progress_bar(caps, show=progress, desc="bucket sizes", unit="size")
    for cap in bar:
        # the default timeout on purpose: the same job settings keep the notebook's warm ranks
        values = run(_overlap_rank, world_size, args=((cap,), width, depth, batch, steps, seed),
                        echo=False).values
        out["runs"][cap] = align(fastest_step([v["runs"][cap] for v in values]))
        out["step_ms"][cap] = [v["step_ms"][cap] for v in values]
        out["buckets"][cap] = values[0]["buckets"][cap]
        out["checksums_equal"] &= len({v["checksum"][cap] for v in values}) == 1
    return out


def fastest_cap(overlap: dict) -> float:
    """The ``bucket_cap_mb`` whose median step time was lowest (notebook 02 prints it).

    ``overlap`` is the notebook's result of :func:`measure_overlap`; the step time
    of a cap is its slowest rank (the step ends when the last rank finishes).
    """
    if not isinstance(overlap, dict) or "step_ms" not in overlap:
        raise ValueError("overlap must be the result of lk.overlap.measure_overlap(): run that "
                         "cell first.")
    return min(overlap["step_ms"], key=lambda cap: max(overlap["step_ms"][cap]))
