"""Cutting the bytes: DDP communication hooks compared on real ranks (notebook 07 §5).

A DDP communication hook (``ddp.register_comm_hook(state, hook)``) replaces the all-reduce of
each gradient bucket. PyTorch ships (``torch.distributed.algorithms.ddp_comm_hooks``):

* ``fp16_compress_hook`` — cast the bucket to float16, all-reduce, cast back: half the bytes,
  an fp16 rounding error (about 2^-11 relative) on every gradient;
* PowerSGD (Vogels et al. 2019) — approximate each gradient matrix M (m×k) by a rank-r
  product P·Qᵀ and all-reduce P (m×r) and Q (k×r) instead: (m+k)·r numbers instead of m·k;
  vectors (biases) are all-reduced as they are. **Error feedback** adds what the
  approximation left out to the next step's gradient, so nothing is lost for good; the first
  ``start_powerSGD_iter`` steps all-reduce uncompressed;
* ``bf16_compress_hook`` — refuses to run without NCCL (torch 2.13: TypeError, measured).

:func:`compare_hooks` trains the same student on the same data and seeds with each hook, in one
job, and a second short job with ``trace=True`` **counts** the bytes every rank sent per step
(``res.trace``, not the hook's word for it). Reported per hook: bytes per step, median step
time (the untraced job), and the held-out loss at the end against the uncompressed baseline.

Example::

    hooks = lk.scaling.compare_hooks(world_size=2)
    print(lk.scaling.hook_table(hooks))
"""
from __future__ import annotations

import statistics

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, slowest_runs

__all__ = ["HOOKS", "make_hook", "compare_hooks", "hook_table", "plot_hooks", "traced_hook_steps",
           "powersgd_bytes"]

HOOKS = ("allreduce", "fp16", "powersgd r=1", "powersgd r=2", "powersgd r=4")
_START_POWERSGD = 2


def make_hook(name: str):
    """``(state, hook)`` for ``ddp.register_comm_hook``; ``(None, None)`` for the default."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return None, None
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name.startswith("powersgd r="):
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.group.WORLD, matrix_approximation_rank=int(name.split("=")[1]),
            start_powerSGD_iter=_START_POWERSGD, use_error_feedback=True, warm_start=True,
            min_compression_rate=1.0, random_seed=0)
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(f"unknown hook {name!r}; choose from {HOOKS} (or 'bf16' on NCCL).")


def _train(rank, world_size, name, steps, batch_size, width, depth, lr):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..runtime import commtrace
    from .task import batch, eval_loss, student
    model = student(width, depth)
    ddp = DDP(model)
    state, hook = make_hook(name)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    times, losses = [], []
    for step in range(steps):
        x, y = batch(step, batch_size, rank, world_size)
        dist.barrier()
        t0 = time.perf_counter()
        with commtrace.label(f"{name} step {step}"):
            opt.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"times": times, "losses": losses, "eval": eval_loss(model),
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "shapes": [tuple(p.shape) for p in model.parameters()]}


def _all_hooks(rank, world_size, names, steps, batch_size, width, depth, lr):
    return {name: _train(rank, world_size, name, steps, batch_size, width, depth, lr)
            for name in names}


def traced_hook_steps(world_size: int = 2, names=HOOKS, steps: int = 4, batch_size: int = 32,
                      width: int = 128, depth: int = 3) -> dict:
    """A short traced job: ``{"trace": CommTrace, "bytes": {hook: [bytes rank 0 sent per
    step]}}`` (every collective DDP or the hook issued, counted by ``lk.run(trace=True)``)."""
    res = run(_all_hooks, world_size, args=(tuple(names), steps, batch_size, width, depth, 0.05),
              trace=True, deadline=JOB_DEADLINE, echo=False)
    per_step = {name: [res.trace.bytes(rank=0, label=f"{name} step {s}") for s in range(steps)]
                for name in names}
    return {"trace": res.trace, "bytes": per_step, "grad_bytes": res.values[0][names[0]][
        "grad_bytes"], "shapes": res.values[0][names[0]]["shapes"]}


def compare_hooks(world_size: int = 2, names=HOOKS, steps: int = 40, batch_size: int = 32,
                  width: int = 128, depth: int = 3, lr: float = 0.05,
                  progress: bool = True) -> dict:
    """Train with every hook in ``names`` (one untraced job) and count their bytes (a traced one).

    Returns ``{"rows": [{hook, bytes_per_step, vs_fp32, step_ms (median, steps after the
    first 3), eval_loss, vs_baseline, losses}], "traced": traced_hook_steps(...),
    "grad_bytes", "world_size"}``.
    """
    names = tuple(names)
    bar = progress_bar(total=2, show=progress, desc="comm hooks", unit="job")
    res = run(_all_hooks, world_size, args=(names, steps, batch_size, width, depth, lr),
              deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    traced = traced_hook_steps(world_size, names, _START_POWERSGD + 2, batch_size, width, depth)
    bar.update(1)
    bar.close()
    base_eval = res.values[0][names[0]]["eval"]
    rows = []
    for name in names:
        per_rank = [res.values[r][name] for r in range(world_size)]
        step_s = slowest_runs([v["times"] for v in per_rank], skip=3)
        sent = traced["bytes"][name][-1]                  # a step after PowerSGD has started
        losses = [sum(v["losses"][i] for v in per_rank) / world_size for i in range(steps)]
        rows.append(dict(hook=name, bytes_per_step=sent, vs_fp32=sent / traced["grad_bytes"],
                         step_ms=statistics.median(step_s) * 1e3, eval_loss=per_rank[0]["eval"],
                         vs_baseline=per_rank[0]["eval"] / base_eval, losses=losses))
    return {"rows": rows, "traced": traced, "grad_bytes": traced["grad_bytes"],
            "world_size": world_size, "steps": steps}


def powersgd_bytes(shapes, rank: int, element_size: int = 4) -> int:
    """Bytes PowerSGD all-reduces per step for parameters of ``shapes`` (a FORMULA): (m+k)·r
    per matrix (P and Q), every element of the vectors."""
    total = 0
    for s in shapes:
        if len(s) >= 2:
            m, k = s[0], 1
            for d in s[1:]:
                k *= d
            total += (m + k) * min(rank, m, k)
        else:
            total += s[0] if s else 1
    return total * element_size


def hook_table(hooks: dict) -> str:
    return table([Col("hook", "hook", "<14"), Col("bytes/step", "bytes_per_step", ">11"),
                  Col("x fp32", "vs_fp32", ">7.3f"), Col("step ms", "step_ms", ">8.2f"),
                  Col("held-out loss", "eval_loss", ">14.4f"),
                  Col("x baseline", "vs_baseline", ">11.3f")], hooks["rows"],
                 above=[f"{hooks['world_size']} ranks, {hooks['steps']} steps, same data and "
                        f"seeds; bytes per step counted by lk.run(trace=True) on rank 0; fp32 "
                        f"gradients = {hooks['grad_bytes']} bytes"])


def plot_hooks(hooks: dict):
    """Training loss per step for every hook (same data, same seeds) and bytes per step."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained",
                               gridspec_kw={"width_ratios": [3, 2]})
    for r in hooks["rows"]:
        a.plot(r["losses"], label=r["hook"])
    a.set_yscale("log")
    a.set(xlabel="step", ylabel="training loss (mean over ranks)",
          title="same data, same seeds, different hooks")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    names = [r["hook"] for r in hooks["rows"]]
    bars = b.barh(names, [r["bytes_per_step"] for r in hooks["rows"]], color="#55A868")
    b.bar_label(bars, fmt="%d", fontsize=7)
    b.set_xscale("log")
    b.invert_yaxis()
    b.set(xlabel="bytes all-reduced per step (counted, rank 0)", title="what each hook sends")
    plt.close(fig)
    return fig
