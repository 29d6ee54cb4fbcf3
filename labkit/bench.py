"""Benchmarks that print tables: ``python -m labkit.bench NAME [options]``.

Speed and memory targets are checked here, by people reading a table, never by
timed assertions in tests. Each benchmark lives in the module of the concept it
measures and exposes ``cli(argv)``; this file only dispatches.

    python -m labkit.bench launch       # rank start-up: cold, warm, plain mp.spawn; pool memory
    python -m labkit.bench allreduce    # dist.all_reduce vs hand-written ring vs naive
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "launch": ("labkit.launch_bench", "rank start-up latency and warm-pool memory"),
    "allreduce": ("labkit.bandwidth", "all-reduce time, algbw and busbw by message size"),
    "sharding": ("labkit.sharding.bench", "memory per rank and step time: DDP, ZeRO-1/2/3, FSDP2"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print("usage: python -m labkit.bench NAME [options]\n")
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name:<10} {what}")
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return module.cli(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
