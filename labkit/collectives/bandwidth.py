"""All-reduce bandwidth, measured: dist.all_reduce vs the hand-written ring vs naive (notebook 03).

Reports what nccl-tests reports (NVIDIA/nccl-tests: doc/PERFORMANCE.md):

* **time** — median over runs of the slowest rank's time for one all-reduce (a run of a small
  message is a few back-to-back calls, their mean: :func:`_calls`);
* **algbw** = S / time (S: the tensor's bytes);
* **busbw** = algbw · 2(N-1)/N — the bytes each rank's link really carried per second in a
  bandwidth-optimal all-reduce, so it compares across world sizes and with the link speed.

An α–β model (time = steps·α + bytes on the busiest link·β) is fitted to the ring's
measurements (:func:`fit`); :func:`at_scale` evaluates the same model with published
NVLink / InfiniBand bandwidths for 8 to 1024 GPUs — a **model prediction**, not a measurement.

Command (the full sweep; the notebook measures a few sizes)::

    python -m labkit bench allreduce            # 4 KiB..4 MiB, 2 and 4 ranks
    python -m labkit bench allreduce --full     # 4 KiB..64 MiB

Example::

    rows = lk.bandwidth.measure(sizes=[2**16, 2**20], world_sizes=(2,))
    print(lk.bandwidth.table(rows))
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Iterable

from ..common.progress import progress as progress_bar
from ..common.tables import Col
from ..common.tables import table as text_table
from ..runtime import run

__all__ = ["measure", "table", "ratios", "paired", "plot", "fit", "fit_alpha_beta", "link_text",
           "predict", "at_scale", "scale_table", "plot_scale", "main", "IMPLS", "SIZES",
           "FULL_SIZES", "LINKS", "cluster_link", "fmt_bytes"]

KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30
IMPLS = ("dist.all_reduce", "ring", "naive")
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB)                 # the notebook: a few seconds
FULL_SIZES = tuple(4 ** k * 4 * KiB for k in range(8))        # 4 KiB, 16 KiB .. 64 MiB
# Published link speeds, one direction (bytes/s), and an assumed per-step latency.
LINKS = {
    "nvlink": dict(name="NVLink 4 (H100 SXM, inside a node)", bandwidth=450e9, alpha=2e-6,
                   source="NVIDIA H100 datasheet: 900 GB/s NVLink per GPU, both directions"),
    "infiniband": dict(name="InfiniBand NDR (one 400 Gb/s NIC; 8 per 8-GPU node)",
                       bandwidth=50e9, nics_per_node=8, alpha=5e-6,
                       source="NVIDIA DGX H100: 8x ConnectX-7 per node, 400 Gb/s = 50 GB/s each"),
}


def cluster_link(gpus: int) -> dict:
    """The link an all-reduce over ``gpus`` H100s runs at (MODEL: see :data:`LINKS`).

    Up to 8 GPUs: one node, NVLink. Beyond: the ring crosses nodes. NCCL runs many channels
    (rings) at once, and each crosses a node boundary through another NIC, so a node's 8 NICs
    carry its share of the traffic together: every byte a GPU sends in the ring (2(N-1)/N·S) leaves
    the node once, through one of 8 NICs, while every GPU also sends that much over NVLink. The
    busiest link then moves at min(NVLink, NICs per node × NIC) = min(450, 8 × 50) = 400 GB/s, not
    at one NIC's 50 GB/s (nccl-tests reports cross-node busbw close to NICs × NIC bandwidth:
    NVIDIA/nccl-tests issues #119, #290, #309). Latency per step is the NIC's α.

    Returns ``{name, bandwidth, alpha}``.
    """
    nv, ib = LINKS["nvlink"], LINKS["infiniband"]
    if gpus <= 8:
        return {"name": nv["name"], "bandwidth": nv["bandwidth"], "alpha": nv["alpha"]}
    nics = ib["nics_per_node"] * ib["bandwidth"]
    return {"name": f"InfiniBand NDR x 8 NICs per node: {min(nv['bandwidth'], nics) / 1e9:g} GB/s",
            "bandwidth": min(nv["bandwidth"], nics), "alpha": ib["alpha"]}


def fmt_bytes(n: float) -> str:
    """4096 -> '4 KiB', 1048576 -> '1 MiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _iters(nbytes: int) -> int:
    return 20 if nbytes <= 64 * KiB else 10 if nbytes <= MiB else 12   # 12: paired ratios


def _calls(nbytes: int) -> int:
    """Back-to-back calls timed as one run: enough for ~16 MiB, at most 8, so that the skew
    between ranks leaving the barrier (~1 ms here) is diluted over the calls (for the smallest
    messages it still weighs on each call's time)."""
    return max(1, min(8, -(-16 * MiB // nbytes)))


def _bench_job(rank: int, world_size: int, nbytes: int, impls: tuple, iters: int):
    """In every rank: time each implementation ``iters`` times after 1 warm-up, interleaved
    and in alternating order (A B C, C B A, ...), so each run of one has a run of the others
    beside it in time (paired ratios) and none is always first after the barrier. A run is
    :func:`_calls` back-to-back calls; its time is their mean."""
    import time

    import torch
    import torch.distributed as dist

    from ..common.ranks import uses_nccl
    from .allreduce import naive_all_reduce, ring_all_reduce
    fns = {"dist.all_reduce": dist.all_reduce, "ring": ring_all_reduce, "naive": naive_all_reduce}
    cuda = uses_nccl()
    t = torch.ones(nbytes // 4, device=torch.device("cuda", rank) if cuda else "cpu")
    calls = _calls(nbytes)
    times = {name: [] for name in impls}
    for i in range(iters + 1):
        for name in impls if i % 2 else impls[::-1]:
            t.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name](t)
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / calls
            want = world_size ** calls                 # each call sums: 1 -> N -> N^2 ...
            if t[0].item() != want or t[-1].item() != want:
                raise RuntimeError(f"{name} gave {t[0].item()} on rank {rank}, expected "
                                   f"{want}: the benchmark would time a wrong result")
            if i:
                times[name].append(dt)
    return times


def measure(sizes: Iterable[int] = SIZES, world_sizes: Iterable[int] = (2, 4),
            impls: Iterable[str] = IMPLS, iters: int | None = None, backend: str = "auto",
            progress: bool = True) -> list[dict]:
    """Time each all-reduce for each message size and world size on real ranks.

    Args:
        sizes: message sizes in bytes (float32 tensors of ``size // 4`` elements).
        world_sizes: rank counts to run (each a job of its own).
        impls: any of :data:`IMPLS`.
        iters: timed runs per point (default: 20 up to 64 KiB, 10 up to 1 MiB, 12 above).

    Returns rows ``{world_size, impl, bytes, time_s, algbw, busbw, runs, runs_s, backend}``
    (bandwidths in GB/s; ``runs_s``: each run's time, in the order run).
    """
    impls, sizes, world_sizes = tuple(impls), list(sizes), list(world_sizes)
    bad = [i for i in impls if i not in IMPLS]
    if bad or not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"impls must come from {IMPLS} (got {bad}) and sizes must be >= 4 "
                         f"bytes (float32), got {sizes}.")
    jobs = [(n, s) for n in world_sizes for s in sizes]
    bar = progress_bar(total=len(jobs), show=progress, unit="job")
    rows = []
    for n, s in jobs:
        bar.set_description(f"{n} ranks, {fmt_bytes(s)}")
        k = iters or _iters(s)
        res = run(_bench_job, n, args=(s, impls, k), backend=backend, timeout=120, echo=False)
        for name in impls:
            per_run = [max(v[name][i] for v in res.values) for i in range(k)]  # slowest rank
            t = statistics.median(per_run)
            algbw = s / t / 1e9
            rows.append(dict(world_size=n, impl=name, bytes=s, time_s=t, algbw=algbw,
                             busbw=algbw * 2 * (n - 1) / n, runs=k, runs_s=per_run,
                             backend=res.backend if hasattr(res, "backend") else backend))
        bar.update(1)
    bar.close()
    return rows


def paired(row: dict, ref: dict) -> list[float]:
    """``row``'s time / ``ref``'s, run by run (run i of each ran side by side), sorted; one
    ratio of medians for rows without their runs."""
    if row.get("runs_s") and ref.get("runs_s"):
        return sorted(a / b for a, b in zip(row["runs_s"], ref["runs_s"]))
    return [row["time_s"] / ref["time_s"]]


def table(rows: list[dict]) -> str:
    """The measurements as a text table, with each time relative to dist.all_reduce's: the
    median of the paired per-run ratios (their range in brackets)."""
    ref = {(r["world_size"], r["bytes"]): r for r in rows if r["impl"] == "dist.all_reduce"}

    def rel(r: dict) -> str:
        base = ref.get((r["world_size"], r["bytes"]))
        if base is None:
            return "-"
        p = paired(r, base)
        return f"{statistics.median(p):.2f}" + (f" ({p[0]:.2f}-{p[-1]:.2f})" if len(p) > 1 else "")
    return text_table([Col("ranks", "world_size", ">5"),
                       Col("size", lambda r: fmt_bytes(r["bytes"]), ">8"),
                       Col("impl", "impl", "<16"),
                       Col("time ms", lambda r: r["time_s"] * 1e3, ">9.3f"),
                       Col("algbw GB/s", "algbw", ">11.3f"), Col("busbw GB/s", "busbw", ">11.3f"),
                       Col("x dist (range)", rel, ">18")], rows)


def ratios(rows: list[dict], impl: str = "ring", world_size: int = 2,
           min_bytes: int = MiB) -> list[float]:
    """``impl``'s time / dist.all_reduce's for each message >= ``min_bytes`` on ``world_size``
    ranks: the median of the paired per-run ratios (:func:`paired`)."""
    ref = {r["bytes"]: r for r in rows
           if r["impl"] == "dist.all_reduce" and r["world_size"] == world_size}
    return [statistics.median(paired(r, ref[r["bytes"]])) for r in rows if r["impl"] == impl
            and r["world_size"] == world_size and r["bytes"] >= min_bytes and r["bytes"] in ref]


def _figure(**kw):
    """A Figure that shows as a picture when a cell returns it.

    Made through pyplot, which switches on the kernel's inline backend (a bare
    ``matplotlib.figure.Figure`` shows as ``<Figure size ...>`` text in JupyterLab),
    then closed so pyplot does not show it a second time at the end of the cell.
    """
    import matplotlib.pyplot as plt

    fig = plt.figure(**kw)
    plt.close(fig)
    return fig


def plot(rows: list[dict], models: list[dict] | None = None):
    """busbw against message size, one panel per world size (a matplotlib Figure)."""
    sizes_by_n = sorted({r["world_size"] for r in rows})
    fig = _figure(figsize=(5.2 * len(sizes_by_n), 3.8), dpi=80)
    for i, n in enumerate(sizes_by_n):
        ax = fig.add_subplot(1, len(sizes_by_n), i + 1)
        for impl in IMPLS:
            pts = sorted((r["bytes"], r["busbw"]) for r in rows
                         if r["world_size"] == n and r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl} (measured)")
        for m in models or []:
            if m["world_size"] == n:
                xs = sorted({r["bytes"] for r in rows if r["world_size"] == n})
                ys = [s / predict(m["alpha"], m["beta"], s, n) / 1e9 * 2 * (n - 1) / n for s in xs]
                ax.plot(xs, ys, "k--", lw=1, label=f"{m['impl']}: α–β model fit")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["bytes"] for r in rows if r["world_size"] == n})
        ax.set_xticks(ticks, [fmt_bytes(t) for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("message size")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"all-reduce, {n} ranks ({rows[0].get('backend', '')})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ the α–β model
def predict(alpha: float, beta: float, nbytes: float, world_size: int,
            algorithm: str = "ring") -> float:
    """Model time of one all-reduce: α per step plus β per byte on the busiest link.

    ring: 2(N-1)·α + 2(N-1)/N·S·β;  naive: 2(N-1)·α + 2(N-1)·S·β (all through rank 0);
    tree (NCCL's double binary tree, roughly): 2·log2(N)·α + 2·S·β.
    """
    import math
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    if algorithm == "naive":
        return 2 * (n - 1) * alpha + 2 * (n - 1) * nbytes * beta
    if algorithm == "tree":
        return 2 * math.log2(n) * alpha + 2 * nbytes * beta
    raise ValueError(f"algorithm must be 'ring', 'naive' or 'tree', got {algorithm!r}.")


# Two-sided 95 % Student t quantiles by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(dof: int) -> float:
    """t for ``dof`` degrees of freedom; between table entries, the next smaller one's (a
    larger t: the range errs wide)."""
    return _T95[max(d for d in _T95 if d <= max(dof, 1))]


def fit_alpha_beta(points: Iterable[tuple[float, float, float]]) -> dict:
    """Fit ``time = steps·α + link_bytes·β`` to ``points`` = ``(steps, link_bytes, time_s)``,
    by least squares on relative error (small and large messages count alike), and say what
    the points can resolve.

    Returns ``alpha``, ``beta`` (β clipped at 1e-15 for use in the model; a negative α is set
    to 0 and β refitted alone, ``alpha_clipped``), their standard errors ``alpha_se``,
    ``beta_se`` (from the residuals; ``nan`` with only 2 sizes), ``dof`` (sizes − parameters),
    ``resolved`` (β above ``t``·se, ``t`` the two-sided 95 % Student quantile for ``dof``:
    the times grow with size more than their scatter explains), ``link_GBps`` (1/β),
    ``link_GBps_range`` (1/(β ± t·se); ``inf`` above when β − t·se ≤ 0; ``nan`` with 2
    sizes) and ``worst_error`` (the largest relative gap between the fit and a point).

    The range is a rough spread, not a confidence interval: with a few sizes the misfit is
    partly systematic (protocol changes, caches), not independent noise, and the weighted
    formula is itself an approximation. When β is not resolved, 1/β is no link speed
    (:func:`link_text` gives only the lower bound the points set); ``beta`` is still the
    estimate, which a model built on it keeps.
    """
    import numpy as np

    pts = [(float(st), float(lb), float(t)) for st, lb, t in points]
    if len(pts) < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 message sizes; got {len(pts)}")
    a = np.array([[st / t, lb / t] for st, lb, t in pts])
    y = np.ones(len(pts))
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    alpha_clipped = float(coef[0]) < 0
    nan = float("nan")
    if alpha_clipped:     # no negative start-up time: refit β alone, with α = 0
        b = a[:, 1]
        coef = np.array([0.0, float(b @ y / (b @ b))])
        dof = len(pts) - 1
        resid = y - a @ coef
        alpha_se, beta_se = 0.0, float(np.sqrt(float(resid @ resid) / dof / float(b @ b)))
    else:
        dof = len(pts) - 2
        if dof > 0:
            resid = y - a @ coef
            cov = float(resid @ resid) / dof * np.linalg.pinv(a.T @ a)
            alpha_se, beta_se = (float(x) for x in np.sqrt(np.maximum(np.diag(cov), 0.0)))
        else:
            alpha_se = beta_se = nan
    raw_beta, t = float(coef[1]), _t95(max(dof, 1))
    alpha, beta = max(float(coef[0]), 0.0), max(raw_beta, 1e-15)
    resolved = raw_beta > 0 and (dof == 0 or raw_beta > t * beta_se)
    if dof > 0:
        low, high = raw_beta + t * beta_se, raw_beta - t * beta_se
        rng = (1e-9 / low if low > 0 else float("inf"), 1e-9 / high if high > 0 else float("inf"))
    else:
        rng = (nan, nan)
    worst = max(abs(st * alpha + lb * beta - t_) / t_ for st, lb, t_ in pts)
    return dict(alpha=alpha, beta=beta, alpha_se=alpha_se, beta_se=beta_se, dof=dof,
                alpha_clipped=alpha_clipped, resolved=resolved, link_GBps=1e-9 / beta,
                link_GBps_range=rng, worst_error=worst)


def link_text(m: dict) -> str:
    """What a fit (:func:`fit_alpha_beta`) says about the link, in words a reader can trust."""
    lo, hi = m["link_GBps_range"]
    if not m["resolved"]:
        bound = (f": the points rule out links slower than about {lo:.2g} GB/s (a rough "
                 f"bound), faster ones cannot be told apart" if math.isfinite(lo) and lo > 0
                 else "")
        return ("1/beta not resolved, the growth with size cannot be told from the scatter "
                f"(times flat or too noisy){bound}; measure larger messages, or repeat")
    if m["dof"] == 0:
        return f"1/beta = {m['link_GBps']:.2f} GB/s (2 sizes: no uncertainty estimate)"
    top = f"{hi:.2f}" if math.isfinite(hi) else "inf"
    return (f"1/beta = {m['link_GBps']:.2f} GB/s (rough 95% range {lo:.2f} to {top}, from "
            f"{m['dof'] + (1 if m['alpha_clipped'] else 2)} sizes)")


def fit(rows: list[dict], impl: str = "ring") -> list[dict]:
    """Fit α (s per step) and β (s per byte) to the measurements of ``impl``, per world size
    (:func:`fit_alpha_beta`). Returns its dicts with ``impl`` and ``world_size`` added."""
    out = []
    for n in sorted({r["world_size"] for r in rows if r["impl"] == impl}):
        pts = [(r["bytes"], r["time_s"]) for r in rows
               if r["impl"] == impl and r["world_size"] == n]
        if len(pts) < 2:
            raise ValueError(f"fitting needs at least 2 message sizes for {impl} on {n} ranks.")
        unit = predict(1.0, 0.0, 1, n, impl), predict(0.0, 1.0, 1, n, impl)  # steps, bytes/S
        out.append(dict(impl=impl, world_size=n,
                        **fit_alpha_beta((unit[0], unit[1] * s, t) for s, t in pts)))
    return out


def at_scale(gpus: Iterable[int] = (8, 16, 64, 256, 1024),
             sizes: Iterable[int] = (MiB, 64 * MiB, GiB)) -> list[dict]:
    """MODEL PREDICTION for big clusters from published link speeds (:func:`cluster_link`).

    8 GPUs: one node, NVLink. More: the ring crosses nodes through all 8 NICs of each node at
    once (NCCL's channels). Rows: gpus, bytes, link, ring_s, tree_s.
    """
    out = []
    for n in gpus:
        link = cluster_link(n)
        for s in sizes:
            out.append(dict(gpus=n, bytes=s, link=link["name"],
                            ring_s=predict(link["alpha"], 1 / link["bandwidth"], s, n, "ring"),
                            tree_s=predict(link["alpha"], 1 / link["bandwidth"], s, n, "tree")))
    return out


def scale_table(rows: list[dict]) -> str:
    """:func:`at_scale` rows as text, headed MODEL PREDICTION, with the figures used."""
    below = [f"  {v['name']}: {v['bandwidth'] / 1e9:g} GB/s per direction ({v['source']}); "
             f"alpha = {v['alpha'] * 1e6:g} us per step (assumed)" for v in LINKS.values()]
    below.append("  beyond 8 GPUs the ring's channels use every NIC of a node: min(NVLink, 8 "
                 "NICs) = 400 GB/s per GPU (assumed: 8 GPUs and 8 NICs per node, NCCL's "
                 "channels spread evenly)")
    return text_table([Col("GPUs", "gpus", ">5"),
                       Col("size", lambda r: fmt_bytes(r["bytes"]), ">8"),
                       Col("ring ms", lambda r: r["ring_s"] * 1e3, ">9.3f"),
                       Col("tree ms", lambda r: r["tree_s"] * 1e3, ">9.3f"),
                       Col("link", "link")], rows, sep="  ", below=below,
                      above=["MODEL PREDICTION (alpha-beta model with published link speeds; "
                             "not measured)"])


def plot_scale(rows: list[dict]):
    """Ring vs tree time against GPU count, one line per message size (MODEL PREDICTION)."""
    fig = _figure(figsize=(6.4, 3.8), dpi=80)
    ax = fig.add_subplot()
    for s in sorted({r["bytes"] for r in rows}):
        pts = sorted((r["gpus"], r["ring_s"], r["tree_s"]) for r in rows if r["bytes"] == s)
        g, ring, tree = zip(*pts)
        line, = ax.plot(g, [t * 1e3 for t in ring], marker="o", label=f"ring, {fmt_bytes(s)}")
        ax.plot(g, [t * 1e3 for t in tree], ls="--", marker="x", color=line.get_color(),
                label=f"tree, {fmt_bytes(s)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("all-reduce time (ms)")
    ax.set_title("MODEL PREDICTION (alpha-beta model, published link speeds), not measured",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit bench allreduce [--full] [--sizes ...] [--world-sizes ...]``."""
    p = argparse.ArgumentParser(prog="python -m labkit bench allreduce",
                                description="all-reduce time, algbw and busbw by message size")
    p.add_argument("--full", action="store_true", help="4 KiB..64 MiB (default 4 KiB..4 MiB)")
    p.add_argument("--sizes", type=int, nargs="+", help="message sizes in bytes")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, help="timed runs per point")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--plot", metavar="PNG", help="save the busbw plot here")
    a = p.parse_args(argv)
    rows = measure(a.sizes or (FULL_SIZES if a.full else SIZES), a.world_sizes,
                   iters=a.iters, backend=a.backend, progress=sys.stderr.isatty())
    print(f"all-reduce of float32 tensors; time = median over runs of the slowest rank (a run: "
          f"up to 8 back-to-back calls, fewer from 4 MiB, their mean); "
          f"busbw = algbw * 2(N-1)/N; x dist = median (range) of the per-run ratios to "
          f"dist.all_reduce, the implementations run side by side in alternating order\n"
          f"{table(rows)}\n")
    r = ratios(rows, min_bytes=4 * MiB)
    if r:
        print(f"ring / dist.all_reduce on 2 ranks, messages >= 4 MiB, median of paired runs: "
              f"{min(r):.2f}x .. {max(r):.2f}x (target <= 1.2x)\n")
    for m in fit(rows):
        print(f"alpha-beta fit, ring on {m['world_size']} ranks: alpha = {m['alpha'] * 1e6:.1f} us"
              f"/step, {link_text(m)}, worst error {m['worst_error']:.0%}")
    print("\n" + scale_table(at_scale()))
    if a.plot:
        plot(rows, fit(rows)).savefig(a.plot)
        print(f"\nplot saved to {a.plot}")
    return 0
