"""The lab's commands: ``python -m labkit COMMAND [options]``.

    python -m labkit grade SUBMISSION...       # auto-grade notebooks (labkit.grading.grader)
    python -m labkit gradescope LESSON         # a Gradescope autograder zip (labkit.grading.gradescope)
    python -m labkit students [--check] [NN]   # student notebooks from solutions/ (labkit.grading.students)
    python -m labkit site [--out DIR]          # the executed solved notebooks as a site (labkit.grading.site)
    python -m labkit minutes [NN...]           # each section's minutes by the stated method (labkit.grading.minutes)
    python -m labkit export PROJECT DEST       # a project of the lab, as a folder of its own
    python -m labkit bench NAME [options]      # benchmarks that print tables (see `bench` alone)
    python -m labkit nccl-capture [SCENARIO]   # record real NCCL failure logs on a GPU machine

Each command lives in the module of the concept it serves and exposes ``main(argv)``; this
file only dispatches. Speed and memory targets are checked by reading the benchmark tables,
never by timed assertions in tests.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "grade": ("labkit.grading.grader", "auto-grade submitted notebooks"),
    "gradescope": ("labkit.grading.gradescope", "build a Gradescope autograder zip for a lesson"),
    "students": ("labkit.grading.students", "generate student notebooks from solutions/"),
    "site": ("labkit.grading.site", "render the executed solved notebooks as a static site"),
    "minutes": ("labkit.grading.minutes", "each section's minutes by the README's method"),
    "export": ("labkit.common.projects", "write notebook 05's or 08's project into a folder"),
    "bench": (None, "benchmarks that print tables (run `bench` alone for the list)"),
    "nccl-capture": ("labkit.pitfalls.nccl_capture", "record real NCCL failure logs (GPU)"),
}
BENCHMARKS = {
    "launch": ("labkit.runtime.bench", "launch latency against other launchers, warm-pool memory"),
    "allreduce": ("labkit.collectives.bandwidth", "all-reduce time, algbw and busbw by size"),
    "sharding": ("labkit.sharding.bench", "memory per rank and step time: DDP, ZeRO-1/2/3, FSDP2"),
    "scaling": ("labkit.scaling.bench", "scaling table, every collective's cost, comm hooks"),
    "grading": ("labkit.grading.bench", "grading time and peak memory per lesson (Gradescope)"),
    "sequences": ("labkit.sequences_experts.bench",
                  "sequence parallelism, ring attention vs Ulysses, all-to-all and MoE steps"),
}


def _dispatch(table: dict, argv: list[str], usage: str) -> int:
    if not argv or argv[0] not in table:
        print(f"usage: {usage}\n")
        for name, (_, what) in table.items():
            print(f"  {name:<14} {what}")
        return 2
    return importlib.import_module(table[argv[0]][0]).main(argv[1:]) or 0


def bench(argv: list[str]) -> int:
    return _dispatch(BENCHMARKS, argv, "python -m labkit bench NAME [options]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return bench(argv[1:])
    return _dispatch(COMMANDS, argv, "python -m labkit COMMAND [options]")


if __name__ == "__main__":
    sys.exit(main())
