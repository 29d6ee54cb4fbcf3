"""Batch size and learning rate: the global batch grows with the ranks (notebook 07 §9).

With DDP each rank keeps its batch b, so n ranks take steps of n·b samples and, for the same
number of samples, n times fewer steps. Left at the single-process learning rate the run falls
behind; the **linear scaling rule** (Goyal et al. 2017, "Accurate, Large Minibatch SGD")
multiplies the learning rate by n, with a **warm-up** that ramps it up over the first steps.
The rule has a limit: it assumes one step of k·b samples does what k steps of b do, which fails
when the loss changes much over those k steps, so at a large enough batch a run that follows
the rule ends worse on the same samples (Goyal et al. saw it past 8k images on ImageNet). And a
rate far past the rule diverges at any batch. It is a rule for SGD: Adam-trained transformers
are tuned, or scaled by about the square root of the batch (Malladi et al. 2022).

:func:`lr_runs` trains the student on real ranks for each configuration of ``configs`` (all in
one job: a 1-rank run uses rank 0 while the others wait in a barrier) on the same samples:
every run reads one stream of ``samples`` training samples in the same order, whatever its batch
(global step s takes the next ranks·batch of them, rank r its r-th slice). Returns the
loss after each step (the mean over ranks of their shard's loss) and the held-out loss at the
end.

Example::

    runs = lk.scaling.lr_runs()
    lk.scaling.plot_lr_runs(runs)
"""
from __future__ import annotations

import math

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE

__all__ = ["DEFAULT_CONFIGS", "warmup_lr", "lr_runs", "lr_table", "plot_lr_runs", "diverged"]

# name: (ranks, batch per rank, learning rate, warm-up steps)
DEFAULT_CONFIGS = {
    "1 rank, batch 16, lr 0.025": (1, 16, 0.025, 0),
    "4 ranks x 16, lr 0.025 (not scaled)": (4, 16, 0.025, 0),
    "4 ranks x 16, lr 0.1 (linear rule + warm-up)": (4, 16, 0.1, 5),
    "4 ranks x 128, lr 0.8 (linear rule at 32x the batch)": (4, 128, 0.8, 1),  # 5 steps: no room for a warm-up
    "4 ranks x 16, lr 0.8 (8x past the rule + warm-up)": (4, 16, 0.8, 10),
}


def warmup_lr(base: float, step: int, warmup: int) -> float:
    """Linear warm-up: ``base * (step + 1) / warmup`` for the first ``warmup`` steps."""
    return base * min(1.0, (step + 1) / warmup) if warmup else base


def _lr_rank(rank, world_size, configs, samples, width, depth, momentum):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .task import IN_DIM, eval_loss, label, student
    stream = torch.randn(samples, IN_DIM, generator=torch.Generator().manual_seed(2024))
    sizes = sorted({c[0] for c in configs.values()})
    groups = {n: dist.new_group(list(range(n))) for n in sizes if n > 1}
    out = {}
    for name, (n, b, lr, warm) in configs.items():
        dist.barrier()
        if rank >= n:
            continue
        model = student(width, depth)
        ddp = model if n == 1 else DDP(model, process_group=groups[n])
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        losses = []
        for step in range(samples // (n * b)):
            for g in opt.param_groups:
                g["lr"] = warmup_lr(lr, step, warm)
            start = step * n * b + rank * b         # global step = the next n*b samples
            x = stream[start:start + b]
            y = label(x)
            opt.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = {"losses": losses, "eval": eval_loss(model)}
    return out


def lr_runs(configs: dict | None = None, samples: int = 2560, width: int = 128, depth: int = 3,
            momentum: float = 0.9, progress: bool = True) -> dict:
    """Train one run per configuration ``{name: (ranks, batch_per_rank, lr, warmup_steps)}``.

    Returns ``{name: {"ranks", "batch", "global_batch", "lr", "warmup", "steps",
    "losses" (per step, mean over ranks), "samples_seen" (per step), "eval", "diverged"}}``.
    """
    configs = dict(configs or DEFAULT_CONFIGS)
    n = max(c[0] for c in configs.values())
    bar = progress_bar(total=1, show=progress, desc=f"{len(configs)} training runs", unit="job")
    res = run(_lr_rank, n, args=(configs, samples, width, depth, momentum), deadline=JOB_DEADLINE,
              echo=False)
    bar.update(1)
    bar.close()
    out = {}
    for name, (ranks, b, lr, warm) in configs.items():
        per_rank = [res.values[r][name]["losses"] for r in range(ranks)]
        losses = [sum(ls) / ranks for ls in zip(*per_rank)]
        ev = res.values[0][name]["eval"]
        out[name] = dict(ranks=ranks, batch=b, global_batch=ranks * b, lr=lr, warmup=warm,
                         steps=len(losses), losses=losses, eval=ev,
                         samples_seen=[(i + 1) * ranks * b for i in range(len(losses))],
                         diverged=diverged(losses + [ev]))
    return out


def diverged(losses) -> bool:
    """A run diverged when a loss is not finite or ends 10x above where it started."""
    return any(not math.isfinite(v) for v in losses) or losses[-1] > 10 * losses[0]


def lr_table(runs: dict) -> str:
    def fmt(v: float) -> str:
        return f"{v:.4f}" if math.isfinite(v) and v < 1e6 else "diverged"
    return table([Col("run", "name", "<52"), Col("global batch", "global_batch", ">12"),
                  Col("steps", "steps", ">6"),
                  Col("final train loss", lambda r: fmt(r["losses"][-1]), ">17"),
                  Col("held-out loss", lambda r: fmt(r["eval"]), ">14")],
                 [{"name": name, **r} for name, r in runs.items()])


def plot_lr_runs(runs: dict):
    """Loss against samples seen, one line per run (log scale; diverged runs are cut at 10)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    for name, r in runs.items():
        ys = [min(v, 10.0) if math.isfinite(v) else 10.0 for v in r["losses"]]
        ax.plot(r["samples_seen"], ys, label=name + (" — DIVERGED" if r["diverged"] else ""))
    ax.set_yscale("log")
    ax.set_xlabel("training samples seen")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("same samples, same order: only the batch and the learning rate differ",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plt.close(fig)
    return fig
