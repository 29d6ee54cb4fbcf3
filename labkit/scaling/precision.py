"""Mixed precision on this CPU: fp32 vs bf16 autocast vs fp16 with loss scaling (notebook 07 §7).

* **fp32** — everything in float32.
* **bf16 autocast** — ``torch.autocast("cpu", dtype=torch.bfloat16)`` runs the matmuls in
  bfloat16 while the parameters (the *master weights*), their gradients and the optimizer stay
  float32. bf16 keeps fp32's exponent range, so no loss scaling is needed.
* **fp16 autocast + GradScaler** — float16 has 5 exponent bits: small gradients underflow to 0.
  ``torch.amp.GradScaler`` multiplies the loss by a large factor before backward and divides
  the gradients back before the step (skipping steps whose gradients overflowed).

:func:`compare_precision` trains the same student on 2 real ranks with DDP in each mode (same
data and seeds), in paired alternating rounds for the step time, traces a step to count what
DDP all-reduces (autocast does not shrink the gradients: they are fp32 like the master weights)
and reports the held-out loss. Whether bf16 is *faster* depends on the CPU: without native bf16
matrix units, the conversions cost more than they save — the notebook measures it.

Example::

    prec = lk.scaling.compare_precision()
    print(lk.scaling.precision_table(prec))
"""
from __future__ import annotations

import statistics

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, alternating, slowest_runs, step_spread

__all__ = ["MODES", "compare_precision", "precision_table"]

MODES = ("fp32", "bf16 autocast", "fp16 autocast + GradScaler")


def _precision_rank(rank, world_size, steps, rounds, batch_size, width, depth, lr):
    import contextlib
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..runtime import commtrace
    from .task import batch, eval_loss, student
    setups = {}
    for mode in MODES:
        model = student(width, depth)
        setups[mode] = dict(model=model, ddp=DDP(model), step=0, times=[],
                            opt=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                            scaler=torch.amp.GradScaler("cpu") if "fp16" in mode else None)

    def one_step(mode):
        s = setups[mode]
        x, y = batch(s["step"], batch_size, rank, world_size)
        cast = (torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in mode else
                torch.autocast("cpu", dtype=torch.float16) if "fp16" in mode else
                contextlib.nullcontext())
        s["opt"].zero_grad()
        with cast:
            loss = F.mse_loss(s["ddp"](x).float(), y)
        if s["scaler"] is not None:
            s["scaler"].scale(loss).backward()
            s["scaler"].step(s["opt"])
            s["scaler"].update()
        else:
            loss.backward()
            s["opt"].step()
        s["step"] += 1
    per_round = steps // rounds
    for order in alternating(list(MODES), rounds):
        for mode in order:
            for _ in range(per_round):
                dist.barrier()
                t0 = time.perf_counter()
                with commtrace.label(f"{mode} step {setups[mode]['step']}"):
                    one_step(mode)
                setups[mode]["times"].append(time.perf_counter() - t0)
    out = {}
    for mode, s in setups.items():
        p = next(s["model"].parameters())
        out[mode] = dict(times=s["times"], eval=eval_loss(s["model"]), steps=s["step"],
                         param_dtype=str(p.dtype), grad_dtype=str(p.grad.dtype),
                         grad_bytes=sum(q.grad.numel() * q.grad.element_size()
                                        for q in s["model"].parameters()),
                         scale=s["scaler"].get_scale() if s["scaler"] is not None else None)
    return out


def compare_precision(world_size: int = 2, steps: int = 18, rounds: int = 3,
                      batch_size: int = 64, width: int = 192, depth: int = 3, lr: float = 0.05,
                      progress: bool = True) -> dict:
    """Train in each of :data:`MODES` (one job) and trace one step of each (a second, short one).

    Returns ``{"rows": [{mode, step_ms (median, slowest rank, after the first step), eval_loss,
    vs_fp32, param_dtype, grad_dtype, allreduce_bytes (counted by the trace), grad_bytes,
    scale}], "world_size", "steps"}``.
    """
    bar = progress_bar(total=2, show=progress, desc="precision modes", unit="job")
    res = run(_precision_rank, world_size, args=(steps, rounds, batch_size, width, depth, lr),
              deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    traced = run(_precision_rank, world_size, args=(4, 2, batch_size, width, depth, lr),
                 trace=True, deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    bar.close()
    base = res.values[0]["fp32"]["eval"]
    rows = []
    for mode in MODES:
        per_rank = [v[mode] for v in res.values]
        step_s = slowest_runs([v["times"] for v in per_rank], skip=1)
        counted = traced.trace.bytes(rank=0, kind="all_reduce", label=f"{mode} step 3")
        rows.append(dict(mode=mode, step_ms=statistics.median(step_s) * 1e3,
                         step_spread=(min(step_s) * 1e3, max(step_s) * 1e3),
                         eval_loss=per_rank[0]["eval"], vs_fp32=per_rank[0]["eval"] / base,
                         param_dtype=per_rank[0]["param_dtype"],
                         grad_dtype=per_rank[0]["grad_dtype"], allreduce_bytes=counted,
                         grad_bytes=per_rank[0]["grad_bytes"], scale=per_rank[0]["scale"]))
    return {"rows": rows, "world_size": world_size, "steps": steps}


def precision_table(prec: dict) -> str:
    return table([Col("mode", "mode", "<28"), Col("step ms", "step_ms", ">8.2f"),
                  Col("(min-max)", step_spread, ">15"), Col("held-out loss", "eval_loss", ">14.4f"),
                  Col("x fp32", "vs_fp32", ">7.3f"), Col("params", "param_dtype", ">14"),
                  Col("grads", "grad_dtype", ">14"),
                  Col("all-reduced B", "allreduce_bytes", ">14")], prec["rows"],
                 above=[f"{prec['world_size']} ranks with DDP, {prec['steps']} steps per mode, "
                        f"paired alternating rounds; all-reduced bytes per step counted by "
                        f"lk.run(trace=True)"])
