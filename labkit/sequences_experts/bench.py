"""``python -m labkit bench sequences``: notebook 09's benchmarks, three tables.

* sequence parallelism: TP vs TP+SP (and Megatron's regather) on 2 and 4 ranks — activation
  bytes per rank and bytes sent, each beside its formula, step time, the gap to one process
  (:func:`labkit.sequences_experts.sequence_parallel.bench_rows`);
* attention over a split sequence: one process vs the hand ring attention (contiguous and
  load-balanced) vs Ulysses, causal, forward + backward, on 2 and 4 ranks, with the bytes rank 0
  sent and the formula (:func:`labkit.sequences_experts.attention.bench_rows`);
* experts: ``all_to_all_single`` against its α–β formula, the MoE step with a balanced and a
  skewed router, expert parallelism vs one process
  (:func:`labkit.sequences_experts.experts.bench_rows`).

Read the ratios, not the absolute times: on a 2-core machine 4 ranks share 2 cores.
"""
from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit bench sequences", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("sp", "attention", "experts"), action="append",
                   help="run only these tables (repeatable; default: all three)")
    args = p.parse_args(argv)
    only = set(args.only or ("sp", "attention", "experts"))
    from tqdm.auto import tqdm

    from . import attention, experts, sequence_parallel
    steps = [name for name in ("sp", "attention", "experts") if name in only]
    with tqdm(total=len(steps), desc="bench sequences", unit="table") as bar:
        for name in steps:
            if name == "sp":
                rows = [r for n in (2, 4) for r in sequence_parallel.bench_rows(world_size=n)]
                text = ("Sequence parallelism (s=128, b=4, h=256, a=8; the lab's ring halves)\n\n"
                        + sequence_parallel.table(rows))
            elif name == "attention":
                text = ("Attention over a split sequence (causal, 8 heads, 1,024 tokens, head "
                        "dim 64, fp32)\n\n" + attention.bench_table(attention.bench_rows()))
            else:
                text = experts.bench_table(experts.bench_rows())
            bar.update(1)
            tqdm.write(text + "\n")
    return 0
