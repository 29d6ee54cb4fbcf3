"""``python -m labkit bench sharding``: memory per rank and step time of every setup (notebook 06).

For 2 and 4 ranks, trains the same MLP (default 512 → 1024 → 1024 → 512, Ψ = 2,099,712, 8.4 MB
in fp32) with DDP, the hand-written ZeRO-1/2/3 (torch's collectives, and ZeRO-3 also with the
ring halves of notebook 03), ``ZeroRedundancyOptimizer`` and FSDP2 ``fully_shard``, all through
:func:`labkit.sharding.harness.run_setups`: each setup is checked against one process
(``max|Δ|``), its bytes per rank read from storages and its traffic counted; then all setups
are timed side by side, one step each in turn for ``--steps`` rounds (order rotated every round),
so that a change of load on a shared machine hits them alike. Step time = median over rounds
of the slowest rank.

Target: the hand ZeRO-3 within 1.5× of ``fully_shard``'s step time (the ``× FSDP2`` column).
On a shared 2-core machine the ranks compete for the cores (4 ranks: more ranks than cores),
so read the ratios, not the absolute times, and run it twice.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

__all__ = ["measure", "table", "main", "BENCH_SETUPS"]

BENCH_SETUPS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 ring", "ZeroRedundancyOptimizer",
                "FSDP2")


def measure(world_sizes=(2, 4), dims=(512, 1024, 1024, 512), steps: int = 10,
            per_rank: int = 32, setups=BENCH_SETUPS, progress=None) -> list[dict]:
    """One row per (world size, setup): memory of rank 0, step ms, traffic, max|Δ|.

    Memory, traffic and the comparison with one process come from
    :func:`~labkit.sharding.harness.run_setups`; step times from
    :func:`~labkit.sharding.harness.interleaved_step_times` (all setups in turn, ``steps``
    rounds): the median over rounds of the slowest rank.
    """
    from ..runtime import run
    from .harness import interleaved_step_times, run_setups
    rows = []
    for n in world_sizes:
        checked = run(run_setups, n, args=(tuple(setups),),
                      kwargs=dict(dims=dims, steps=2, per_rank=per_rank, collectives="dist"),
                      timeout=120, echo=False).values
        timed = run(interleaved_step_times, n, args=(tuple(setups),),
                    kwargs=dict(dims=dims, rounds=steps, per_rank=per_rank),
                    timeout=120, deadline=900, echo=False).values
        for i, name in enumerate(setups):
            r0 = checked[0][i]
            slowest = [max(t[name][k] for t in timed) for k in range(steps)]
            rows.append({"world_size": n, "setup": name, "impl": r0["impl"],
                         "memory": r0["memory"], "psi": r0["psi"], "ring_sent": r0["ring_sent"],
                         "max_diff": max(c[i]["max_diff"] for c in checked),
                         "step_ms": statistics.median(slowest)})
        if progress:
            progress(n)
    return rows


def table(rows: list[dict]) -> str:
    """A Markdown table of :func:`measure`'s rows, with each step time over FSDP2's."""
    fsdp = {r["world_size"]: r["step_ms"] for r in rows if r["setup"] == "FSDP2"}
    out = ["| ranks | setup | MB per rank (params + grads + optimizer + buckets) | sent per step "
           "(Ψ) | step ms | × FSDP2 | max\\|Δ\\| vs 1 process |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        m, n = r["memory"], r["world_size"]
        unit = 4 * r["psi"] * (n - 1) / n
        parts = " + ".join(f"{(m.get(k) or 0) / 1e6:.2f}" for k in ("params", "grads",
                                                                    "optimizer", "buckets"))
        ratio = r["step_ms"] / fsdp[n] if n in fsdp else float("nan")
        out.append(f"| {n} | {r['impl']} | {m['total'] / 1e6:.2f} ({parts}) | "
                   f"{r['ring_sent'] / unit:.2f} | {r['step_ms']:.1f} | {ratio:.2f} | "
                   f"{r['max_diff']:.1e} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit bench sharding",
                                description="memory per rank and step time: DDP, hand ZeRO-1/2/3, "
                                            "ZeroRedundancyOptimizer, FSDP2 fully_shard")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dims", type=int, nargs="+", default=[512, 1024, 1024, 512])
    p.add_argument("--steps", type=int, default=10, help="timed steps per setup")
    p.add_argument("--per-rank", type=int, default=32, help="batch rows per rank")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"# sharding benchmark: {cores} usable cores, dims {tuple(args.dims)}, "
          f"{args.steps} timed steps, {args.per_rank} rows per rank")
    t0 = time.perf_counter()
    rows = measure(tuple(args.world_sizes), tuple(args.dims), args.steps, args.per_rank,
                   progress=lambda n: print(f"  measured {n} ranks", flush=True))
    print(table(rows))
    for n in args.world_sizes:
        by = {r["setup"]: r["step_ms"] for r in rows if r["world_size"] == n}
        if "ZeRO-3" in by and "FSDP2" in by:
            print(f"{n} ranks: hand ZeRO-3 / fully_shard step time = {by['ZeRO-3'] / by['FSDP2']:.2f}"
                  f" (target <= 1.5)")
    print(f"({time.perf_counter() - t0:.0f} s)")
    from ..runtime import shutdown
    shutdown()
    return 0
