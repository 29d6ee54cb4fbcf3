"""Throughput and scaling efficiency, measured on this machine (notebook 07 §2-§3).

:func:`measure_scaling` trains the lab's student MLP with DDP on 1, 2 and 4 ranks, for
**strong scaling** (the global batch is fixed; each rank gets ``global_batch / n``) and **weak
scaling** (each rank keeps ``per_rank_batch``; the global batch grows with n), plus ``alone``:
weak scaling with no communication at all (each rank trains its own copy), which measures how
many ranks this machine really runs at once. All in ONE 4-rank job: configurations run in paired, alternating rounds (:mod:`labkit.scaling.timing`), each on
a process group of its first n ranks while the others wait in a barrier (blocked, not
spinning). Per configuration and round: warm-up steps, a barrier, timed steps, a barrier; the
step time is the slowest rank's.

    throughput = global samples per step / step time
    speedup(n) = throughput(n) / throughput(1)        (paired: the same round)
    efficiency(n) = speedup(n) / n

:func:`machine` says what the learner's machine can show: with ``cores`` usable CPU cores, n
compute-bound ranks run at most ``min(n, cores)`` at a time, so the speedup cannot pass
``cores`` however many ranks there are (:func:`ceiling`).

Example::

    sc = lk.scaling.measure_scaling()
    print(lk.scaling.scaling_table(sc))
"""
from __future__ import annotations

import os
import time

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import (JOB_DEADLINE, alternating, fmt_spread, ratio_summary, slowest_runs,
                     summary)

__all__ = ["machine", "ceiling", "measure_scaling", "scaling_rows", "scaling_table", "plot_scaling",
           "WORLD_SIZES", "MODES"]

WORLD_SIZES = (1, 2, 4)
# strong: fixed global batch; weak: fixed batch per rank; alone: weak without communication
# (each rank trains its own replica), which measures how many ranks really compute at once.
MODES = ("strong", "weak", "alone")


def machine() -> dict:
    """What this machine has: ``cpu_count`` (os.cpu_count), ``cores`` (usable by this
    process: ``len(os.sched_getaffinity(0))``), ``load`` (1-minute load average)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_count": os.cpu_count(), "cores": cores, "load": os.getloadavg()[0]}


def ceiling(n: int, cores: int) -> float:
    """The best speedup n compute-bound ranks can reach on ``cores`` cores: min(n, cores)."""
    return float(min(n, cores))


def _scaling_rank(rank, world_size, sizes, global_batch, per_rank_batch, width, depth,
                  warmup, steps, rounds):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .task import batch, student
    groups = {n: dist.new_group(list(range(n))) for n in sizes if n > 1}  # every rank joins
    models = {}
    for n in sizes:
        if rank < n:
            m = student(width, depth)
            models[n] = (m if n == 1 else DDP(m, process_group=groups[n]),
                         torch.optim.SGD(m.parameters(), lr=1e-3))
        dist.barrier()
    alone = student(width, depth)                       # no DDP: n ranks computing side by side
    models["alone"] = (alone, torch.optim.SGD(alone.parameters(), lr=1e-3))
    configs = [(mode, n) for mode in MODES for n in sizes]
    times = {f"{mode} {n}": [] for mode, n in configs}
    for order in alternating(configs, rounds):
        for mode, n in order:
            dist.barrier()
            if rank >= n:
                continue                                  # waits in the next barrier
            model, opt = models["alone" if mode == "alone" else n]
            size = global_batch // n if mode == "strong" else per_rank_batch
            sync = groups.get(n)
            for i in range(warmup + steps):
                if i == warmup:
                    if sync is not None:
                        dist.barrier(group=sync)
                    t0 = time.perf_counter()
                x, y = batch(i, size, rank, n)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            own = (time.perf_counter() - t0) / steps
            if sync is not None:
                dist.barrier(group=sync)
            times[f"{mode} {n}"].append(own)
    return times


def measure_scaling(sizes=WORLD_SIZES, global_batch: int = 1024, per_rank_batch: int = 256,
                    width: int = 256, depth: int = 3, warmup: int = 1, steps: int = 4,
                    rounds: int = 3, progress: bool = True) -> dict:
    """Measure DDP throughput at each world size in ``sizes``, strong and weak (one job).

    Returns ``{"rows": [...] (see :func:`scaling_rows`), "step_s": {"strong 2": [per round:
    slowest rank's seconds per step]}, "machine": machine(), "settings": {...}}``.
    """
    sizes = tuple(sorted(set(sizes)))
    if sizes[0] != 1 or global_batch % sizes[-1]:
        raise ValueError(f"sizes must start at 1 (the baseline) and divide global_batch; got "
                         f"sizes={sizes}, global_batch={global_batch}.")
    bar = progress_bar(total=1, show=progress, desc=f"scaling on {sizes} ranks", unit="job")
    res = run(_scaling_rank, max(sizes), args=(sizes, global_batch, per_rank_batch, width,
                                               depth, warmup, steps, rounds),
              deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    bar.close()
    step_s = {}
    for key in res.values[0]:
        n = int(key.split()[1])
        step_s[key] = slowest_runs([res.values[r][key] for r in range(n)])
    settings = dict(sizes=sizes, global_batch=global_batch, per_rank_batch=per_rank_batch,
                    width=width, depth=depth, warmup=warmup, steps=steps, rounds=rounds)
    out = {"step_s": step_s, "machine": machine(), "settings": settings}
    out["rows"] = scaling_rows(out)
    return out


def scaling_rows(sc: dict) -> list[dict]:
    """One row per (mode, n): samples/s, speedup and efficiency (medians of paired rounds,
    with their min-max), and the ceiling this machine's cores allow."""
    st, cores = sc["settings"], sc["machine"]["cores"]
    rows = []
    for mode in MODES:
        base = sc["step_s"][f"{mode} 1"]
        base_samples = st["global_batch"] if mode == "strong" else st["per_rank_batch"]
        for n in st["sizes"]:
            t = sc["step_s"][f"{mode} {n}"]
            samples = st["global_batch"] if mode == "strong" else st["per_rank_batch"] * n
            thr = [samples / s for s in t]
            speed = ratio_summary(thr, [base_samples / s for s in base])
            rows.append(dict(mode=mode, ranks=n, batch_per_rank=samples // n,
                             global_batch=samples, step_ms=summary([s * 1e3 for s in t]),
                             samples_per_s=summary(thr), speedup=speed,
                             efficiency={k: (v / n if k in ("median", "min", "max") else v)
                                         for k, v in speed.items()},
                             ceiling=ceiling(n, cores)))
    return rows


def scaling_table(sc: dict) -> str:
    """The rows of :func:`scaling_rows` as text (medians, min-max in brackets)."""
    m = sc["machine"]
    return table([Col("mode", "mode", "<6"), Col("ranks", "ranks", ">5"),
                  Col("batch/rank", "batch_per_rank", ">10"),
                  Col("step ms", lambda r: fmt_spread(r["step_ms"], digits=1), ">20"),
                  Col("samples/s", lambda r: fmt_spread(r["samples_per_s"], digits=0), ">22"),
                  Col("speedup", lambda r: fmt_spread(r["speedup"], digits=2), ">18"),
                  Col("efficiency", lambda r: fmt_spread(r["efficiency"], digits=2), ">18"),
                  Col("ceiling", lambda r: f"{r['ceiling']:.0f}x", ">8")], sc["rows"],
                 above=[f"measured on this machine: os.cpu_count() = {m['cpu_count']}, usable "
                        f"cores = {m['cores']}, load average {m['load']:.1f}; "
                        f"{sc['settings']['rounds']} paired rounds, slowest rank, median "
                        f"(min-max)"])



def plot_scaling(sc: dict):
    """Speedup against ranks: strong, weak and alone (medians, min-max bars), the ideal n and
    this machine's core ceiling."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    sizes = sc["settings"]["sizes"]
    for mode, marker in zip(MODES, "osd"):
        rows = [r for r in sc["rows"] if r["mode"] == mode]
        med = [r["speedup"]["median"] for r in rows]
        lo = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
        hi = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker=marker, capsize=3,
                    label=f"{mode} (measured)")
    ax.plot(sizes, sizes, "k--", lw=1, label="ideal: n times faster")
    cores = sc["machine"]["cores"]
    ax.plot(sizes, [ceiling(n, cores) for n in sizes], ":", color="grey", lw=2,
            label=f"ceiling of {cores} cores: min(n, {cores})")
    ax.set_xticks(sizes)
    ax.set_xlabel("ranks")
    ax.set_ylabel("speedup over 1 rank")
    ax.set_title(f"measured here (load average {sc['machine']['load']:.1f})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig
