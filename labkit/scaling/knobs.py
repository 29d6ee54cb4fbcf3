"""DDP's knobs that matter, measured on real ranks (notebook 07 §8).

* ``gradient_as_bucket_view=True`` — by default DDP keeps its buckets (flat buffers it
  all-reduces) *and* every parameter's ``.grad``, and copies between them; with the view,
  ``.grad`` tensors are views into the buckets, so one copy of the gradients disappears.
  :func:`grad_memory` reads it from the tensors' storages (params, grads, buckets);
* ``static_graph=True`` — promises the graph is the same every step, so DDP can skip
  per-step bookkeeping (and supports re-entrant checkpointing);
* ``bucket_cap_mb`` — bucket size: how many all-reduces per step (notebook 02 drew their
  timelines; here they are counted with ``lk.run(trace=True)``);
* ``find_unused_parameters=True`` — after each forward DDP walks the autograd graph to find
  parameters that will get no gradient: needed when some do, a cost when none do.

:func:`measure_knobs` times every setting in paired, alternating rounds in one job, then
counts each setting's all-reduces in a short traced job.

Example::

    knobs = lk.scaling.measure_knobs()
    print(lk.scaling.knob_table(knobs))
"""
from __future__ import annotations

import statistics

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, alternating, slowest_runs, step_spread

__all__ = ["SETTINGS", "measure_knobs", "knob_table", "grad_memory"]

SETTINGS = {
    "default (bucket_cap_mb=25)": {},
    "gradient_as_bucket_view=True": {"gradient_as_bucket_view": True},
    "static_graph=True": {"static_graph": True},
    "find_unused_parameters=True": {"find_unused_parameters": True},
    "bucket_cap_mb=1": {"bucket_cap_mb": 1},
    "bucket_cap_mb=0.1": {"bucket_cap_mb": 0.1},
}


def grad_memory(rank, world_size, gradient_as_bucket_view: bool, width: int = 256,
                depth: int = 4) -> dict:
    """In a rank: bytes held per parameter by params, ``.grad`` and DDP's buckets, from the
    tensors' storages (a shared storage counted once)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .task import batch, student
    model = student(width, depth)
    ddp = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
    buckets = {}

    def remember(state, bucket):                    # the flat buffer DDP all-reduces
        s = bucket.buffer().untyped_storage()
        buckets[bucket.index()] = (s.data_ptr(), s.nbytes())
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, remember)
    for step in range(3):                           # buckets are rebuilt after step 1
        x, y = batch(step, 16, rank, world_size)
        ddp.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), y).backward()

    def storages(tensors):
        return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    params = storages(model.parameters())
    grads = storages(p.grad for p in model.parameters())
    every = params | grads | set(buckets.values())
    n = sum(p.numel() for p in model.parameters())
    return {"bytes_per_param": sum(b for _, b in every) / n,
            "grads_are_views": grads <= set(buckets.values()), "params": n}


def _knob_rank(rank, world_size, settings, steps, rounds, batch_size, width, depth):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..runtime import commtrace
    from .task import batch, student
    setups = {}
    for name, kw in settings.items():
        model = student(width, depth)
        setups[name] = dict(ddp=DDP(model, **kw), times=[], step=0,
                            opt=torch.optim.SGD(model.parameters(), lr=1e-3))
    for order in alternating(list(settings), rounds):
        for name in order:
            s = setups[name]
            for _ in range(steps // rounds):
                x, y = batch(s["step"], batch_size, rank, world_size)
                dist.barrier()
                t0 = time.perf_counter()
                with commtrace.label(f"{name} step {s['step']}"):
                    s["opt"].zero_grad()
                    F.mse_loss(s["ddp"](x), y).backward()
                    s["opt"].step()
                s["times"].append(time.perf_counter() - t0)
                s["step"] += 1
    memory = {view: grad_memory(rank, world_size, view, width, depth) for view in (False, True)}
    return {"times": {n: s["times"] for n, s in setups.items()}, "memory": memory}


def measure_knobs(world_size: int = 2, settings: dict | None = None, steps: int = 12,
                  rounds: int = 3, batch_size: int = 64, width: int = 256, depth: int = 4,
                  progress: bool = True) -> dict:
    """Step time (median, slowest rank) and all-reduces per step of each DDP setting, and the
    gradient memory with and without ``gradient_as_bucket_view``."""
    settings = dict(settings or SETTINGS)
    bar = progress_bar(total=2, show=progress, desc="DDP settings", unit="job")
    res = run(_knob_rank, world_size, args=(settings, steps, rounds, batch_size, width, depth),
              deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    traced = run(_knob_rank, world_size, args=(settings, 4, 2, batch_size, width, depth),
                 trace=True, deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    bar.close()
    rows = []
    for name in settings:
        per_rank = [v["times"][name] for v in res.values]
        step_s = slowest_runs(per_rank, skip=1)
        calls = traced.trace.select(rank=0, kind="all_reduce", label=f"{name} step 3")
        rows.append(dict(setting=name, step_ms=statistics.median(step_s) * 1e3,
                         step_spread=(min(step_s) * 1e3, max(step_s) * 1e3),
                         allreduces=len(calls), allreduce_bytes=sum(c["bytes"] for c in calls)))
    return {"rows": rows, "memory": res.values[0]["memory"], "world_size": world_size}


def knob_table(knobs: dict) -> str:
    mem = knobs["memory"]
    return table([Col("setting", "setting", "<32"), Col("step ms", "step_ms", ">8.2f"),
                  Col("(min-max)", step_spread, ">15"), Col("all-reduces", "allreduces", ">12"),
                  Col("bytes", "allreduce_bytes", ">9")], knobs["rows"],
                 above=[f"{knobs['world_size']} ranks; step time: median of the slowest rank "
                        f"over paired alternating rounds; all-reduces per step counted by "
                        f"lk.run(trace=True)"],
                 below=["gradient memory (params + grads + DDP buckets, from storages): "
                        f"{mem[False]['bytes_per_param']:.1f} B/param without the view, "
                        f"{mem[True]['bytes_per_param']:.1f} B/param with "
                        f"gradient_as_bucket_view=True (grads are bucket views: "
                        f"{mem[True]['grads_are_views']})"])
