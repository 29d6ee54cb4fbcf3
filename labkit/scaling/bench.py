"""``python -m labkit bench scaling``: the scaling table, the cost of every collective, the hooks.

Prints three tables, each measured on real gloo ranks of this machine (notebook 07 shows the
same measurements at smaller sizes):

1. **scaling** — samples/s, speedup and efficiency at 1, 2 and 4 ranks, strong and weak (and
   ``alone``: the same ranks with no communication, this machine's ceiling), paired
   alternating rounds, slowest rank, median (min-max);
2. **collectives** — all-reduce, reduce-scatter, all-gather, broadcast and all-to-all on 2 and
   4 ranks against their α–β formulas, with algbw and busbw (nccl-tests conventions);
3. **hooks** — DDP with the default all-reduce, ``fp16_compress_hook`` and PowerSGD (rank 1,
   2, 4; error feedback) on 2 ranks: bytes per step counted by ``lk.run(trace=True)``, step
   time, held-out loss against the uncompressed baseline.

Timings depend on what else the machine runs: the header prints the core count and the load.
"""
from __future__ import annotations

import argparse
import sys
import time

from .costs import cost_table, measure_costs
from .hooks import compare_hooks, hook_table
from .throughput import machine, measure_scaling, scaling_table

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit bench scaling",
                                description="scaling table, collective costs, comm hooks")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds for the scaling table")
    p.add_argument("--sizes", type=int, nargs="+", default=[2 ** k for k in (16, 18, 20, 22, 24)],
                   help="payload sizes (bytes) for the collectives table")
    p.add_argument("--iters", type=int, default=10, help="timed runs per collective and size")
    p.add_argument("--hook-ranks", type=int, nargs="+", default=[2])
    p.add_argument("--only", choices=("scaling", "collectives", "hooks"))
    a = p.parse_args(argv)
    m = machine()
    print(f"python -m labkit bench scaling: {time.strftime('%Y-%m-%d %H:%M')}, "
          f"os.cpu_count() = {m['cpu_count']}, usable cores = {m['cores']}, load average "
          f"{m['load']:.1f}\n")
    show = sys.stderr.isatty()
    if a.only in (None, "scaling"):
        print("1. scaling (DDP, the student MLP)\n" +
              scaling_table(measure_scaling(rounds=a.rounds, progress=show)) + "\n")
    if a.only in (None, "collectives"):
        print("2. the cost of every collective\n" +
              cost_table(measure_costs(a.sizes, (2, 4), iters=a.iters, progress=show)) + "\n")
    if a.only in (None, "hooks"):
        for n in a.hook_ranks:
            print("3. DDP communication hooks\n" +
                  hook_table(compare_hooks(world_size=n, progress=show)) + "\n")
    return 0
