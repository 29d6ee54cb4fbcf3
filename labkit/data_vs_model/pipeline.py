"""Model parallelism for real: one model split over two ranks, its bubble measured (notebook 01 §3).

:func:`pipeline` — activations go forward with ``send``/``recv``, gradients come back the same
way. Each rank records a timeline, so the idle time (the pipeline bubble) is measured, not
drawn; micro-batches shrink it. The split model's gradients are checked against the same model
run whole in one process.

Example::

    pipe = lk.data_vs_model.pipeline(micro_batches=4)
    lk.plots.timeline(pipe["spans"])
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..common.models import mlp
from ..common.ranks import device
from ..common.timeline import Timeline, align, busy_seconds, fastest_step
from ..runtime import run

__all__ = ["pipeline"]


def _pipeline_rank(rank: int, world_size: int, width: int, depth: int, batch: int,
                   micro_batches: int, steps: int, seed: int) -> dict:
    if world_size != 2:
        raise ValueError(f"this pipeline has 2 stages, so it needs world_size=2, got {world_size}.")
    dev = device()
    whole = mlp(width, 2 * depth, seed)         # build it whole, keep only this rank's half
    stage = whole[:depth] if rank == 0 else whole[depth:]
    stage.to(dev)
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=data).to(dev)
    target = torch.randn(batch, width, generator=data).to(dev)
    chunks = list(zip(x.chunk(micro_batches), target.chunk(micro_batches)))
    per_step = []
    for _ in range(steps):                      # the notebook shows the least disturbed step
        dist.barrier()                          # both stages start the step together
        tl = Timeline(rank, cuda_sync=dev.type == "cuda")
        stage.zero_grad()
        outs, sends, mb = [], [], len(chunks)
        for i, (xb, tb) in enumerate(chunks):   # all forwards (GPipe: fill ...)
            if rank == 0:
                with tl.span("forward", label=f"F{i}"):
                    h = stage(xb)
                sends.append(dist.isend(h.detach(), dst=1))
                outs.append(h)
            else:
                h_in = torch.empty(xb.shape[0], width, device=dev)
                with tl.span("idle", label="wait"):
                    dist.recv(h_in, src=0)
                h_in.requires_grad_(True)
                with tl.span("forward", label=f"F{i}"):
                    loss = F.mse_loss(stage(h_in), tb) / mb
                outs.append((h_in, loss))
        for i in range(mb):                     # ... then all backwards (... and drain)
            if rank == 1:
                h_in, loss = outs[i]
                with tl.span("backward", label=f"B{i}"):
                    loss.backward()
                sends.append(dist.isend(h_in.grad, dst=0))
            else:
                grad = torch.empty_like(outs[i])
                with tl.span("idle", label="wait"):
                    dist.recv(grad, src=1)
                with tl.span("backward", label=f"B{i}"):
                    outs[i].backward(grad)
        for s in sends:
            s.wait()
        per_step.append(tl.spans)
    # slicing a Sequential keeps the original names ("3.0.weight"), so names match `whole`
    grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
    return {"steps": per_step, "grads": grads, "params": sum(p.numel() for p in stage.parameters())}


def pipeline(micro_batches: int = 1, width: int = 512, depth: int = 4, batch: int = 512,
             steps: int = 4, seed: int = 0) -> dict:
    """Run a ``2*depth``-layer MLP split across 2 ranks (model parallelism) and measure it.

    Rank 0 holds the first ``depth`` layers, rank 1 the rest and the loss. The
    batch is cut into ``micro_batches`` (GPipe schedule: all forwards, then all
    backwards). Of ``steps`` identical steps, the one that took least time (the
    least disturbed by other programs on the machine) is reported, and the
    gradients are from the last step.

    Returns ``{"spans": [rank][span], "idle": [fraction per rank], "params":
    [count per rank], "max_grad_diff": float, "micro_batches": int}`` where
    ``max_grad_diff`` compares the split model's gradients with the whole model
    run in one process (the oracle).

    Example::

        one = pipeline(micro_batches=1)["idle"]    # each rank idle about half the time
        four = pipeline(micro_batches=4)["idle"]   # less: the bubble shrinks
    """
    res = run(_pipeline_rank, 2, args=(width, depth, batch, micro_batches, steps, seed),
                 echo=False)
    spans = align(fastest_step([v["steps"] for v in res.values]))
    lo = min(s["start"] for r in spans for s in r)
    hi = max(s["end"] for r in spans for s in r)
    whole = mlp(width, 2 * depth, seed)         # the oracle: one process, whole batch
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=data)
    target = torch.randn(batch, width, generator=data)
    F.mse_loss(whole(x), target).backward()
    diff = 0.0
    for v in res.values:
        for name, g in v["grads"].items():
            diff = max(diff, float((g - whole.get_parameter(name).grad).abs().max()))
    # idle = not computing: waiting in recv, or anything else that is not forward/backward
    idle = [1.0 - busy_seconds(s, ("forward", "backward")) / (hi - lo) for s in spans]
    return {"spans": spans, "idle": idle,
            "params": [v["params"] for v in res.values], "max_grad_diff": diff,
            "micro_batches": micro_batches}
