"""When communication hides behind compute: the overlap condition, measured (notebook 07 §4).

DDP starts all-reducing a bucket while backward still computes earlier layers (notebook 02).
The all-reduce can hide completely only if it is not longer than the backward it overlaps:

    overlap condition:   T_allreduce(gradient bytes)  <=  T_backward

and even then the last bucket (the first layers' gradients, ready last) has nothing left to
hide behind. :func:`measure_overlap_condition` measures, for the lab's student at several
widths on real ranks: ``backward_ms`` (``loss.backward()`` with no DDP, all ranks computing at
once), ``allreduce_ms`` (``dist.all_reduce`` of a tensor of the gradients' size), and the step
with and without DDP, whose difference is the communication that did **not** hide
(``exposed_ms``). On a CPU the all-reduce also needs the cores that backward uses (gloo copies
and adds on the CPU), so it cannot hide for free here; on GPUs NCCL runs on its own channels.

Example::

    ov = lk.scaling.measure_overlap_condition(widths=(64, 256, 512))
    print(lk.scaling.overlap_table(ov))
"""
from __future__ import annotations

import statistics

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, slowest_runs

__all__ = ["measure_overlap_condition", "overlap_table"]


def _overlap_rank(rank, world_size, widths, depth, batch_size, iters):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .task import batch, param_count, student

    def timed(fn):
        times = []
        for i in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn(i)
            if i:
                times.append(time.perf_counter() - t0)
        return times
    out = {}
    for w in widths:
        local, wrapped = student(w, depth), DDP(student(w, depth))
        grads = torch.zeros(param_count(local))
        x, y = batch(0, batch_size, rank, world_size)

        def backward_only(i):
            local.zero_grad()
            loss = F.mse_loss(local(x), y)
            t0 = time.perf_counter()
            loss.backward()
            bwd.append(time.perf_counter() - t0)

        def step(model):
            def go(i):
                model.zero_grad()
                F.mse_loss(model(x), y).backward()
            return go
        bwd: list[float] = []
        timed(backward_only)
        out[w] = dict(params=param_count(local), backward=bwd[1:],
                      allreduce=timed(lambda i: dist.all_reduce(grads)),
                      local_step=timed(step(local)), ddp_step=timed(step(wrapped)))
    return out


def measure_overlap_condition(world_size: int = 2, widths=(64, 256, 1024), depth: int = 3,
                              batch_size: int = 64, iters: int = 8,
                              progress: bool = True) -> dict:
    """Backward time vs all-reduce time of the gradients, per width (one job, slowest rank).

    Rows ``{width, params, grad_bytes, backward_ms, allreduce_ms, ratio (= allreduce /
    backward), local_step_ms, ddp_step_ms, exposed_ms (= ddp - local), condition_holds}``.
    """
    bar = progress_bar(total=1, show=progress, desc=f"overlap, widths {widths}", unit="job")
    res = run(_overlap_rank, world_size, args=(tuple(widths), depth, batch_size, iters),
              deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    bar.close()
    rows = []
    for w in widths:
        med = {}
        for key in ("backward", "allreduce", "local_step", "ddp_step"):
            per_run = slowest_runs([v[w][key] for v in res.values])
            med[key] = statistics.median(per_run) * 1e3
        rows.append(dict(width=w, params=res.values[0][w]["params"],
                         grad_bytes=4 * res.values[0][w]["params"], backward_ms=med["backward"],
                         allreduce_ms=med["allreduce"], ratio=med["allreduce"] / med["backward"],
                         local_step_ms=med["local_step"], ddp_step_ms=med["ddp_step"],
                         exposed_ms=med["ddp_step"] - med["local_step"],
                         condition_holds=med["allreduce"] <= med["backward"]))
    return {"rows": rows, "world_size": world_size, "batch_size": batch_size}


def overlap_table(ov: dict) -> str:
    return table([Col("width", "width", ">6"), Col("params", "params", ">9"),
                  Col("backward ms", "backward_ms", ">12.2f"),
                  Col("all-reduce ms", "allreduce_ms", ">14.2f"), Col("ratio", "ratio", ">6.2f"),
                  Col("holds?", lambda r: "yes" if r["condition_holds"] else "no", ">7"),
                  Col("step ms", "local_step_ms", ">8.2f"),
                  Col("DDP step ms", "ddp_step_ms", ">12.2f"),
                  Col("exposed ms", "exposed_ms", ">11.2f")], ov["rows"],
                 above=[f"{ov['world_size']} ranks, batch {ov['batch_size']} per rank; medians "
                        f"of the slowest rank"])
