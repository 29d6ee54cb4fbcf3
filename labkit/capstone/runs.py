"""Reading the capstone's runs (notebook 08, "Throughput per rank count" and "Loss curves").

Rank 0 of ``train_gpt.py`` logs, with ``--log-every 1``, one line per step::

    step   12/40 | epoch 0 | loss 5.184002 | attempt 1 | lr 1.20e-03 | 1335 tok/s

where ``tok/s`` is the running average of this attempt: ``k`` steps timed
since the attempt started, ``k x tokens per step / seconds spent in those
steps`` (sleeps of ``--step-delay`` and checkpoint writes are outside the
timed part). So the seconds spent in the first ``k`` steps are ``k x tokens /
tok/s``, and one step's time is the difference of two such totals. That is
how :func:`step_seconds` reads per-step times from the log, with the method of
notebook 07: the first :data:`WARMUP` steps of every attempt left out (fresh
processes, cold caches), then the median and the quartiles.

Rank 0's step time is the slowest rank's: a step ends with the gradient
reduction, and no rank can have the sum before every rank has sent its part.

Plain Python on a finished torchrun ``Run`` (what ``lk.torchrun.run``/``job.wait()`` return).
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass


__all__ = ["WARMUP", "step_seconds", "Throughput", "throughput", "sample", "script_args",
           "plot_throughput"]

WARMUP = 3
_STEP = re.compile(r"step\s+(\d+)/\d+ \| .*\| attempt (\d+) \| .*\| ([0-9.]+) tok/s")
_RESUMED = re.compile(r"^resumed from .*: step (\d+),.*\| attempt (\d+)$")


def script_args(run) -> list[str]:
    """The script's own arguments in ``run``'s torchrun command."""
    cmd = [str(a) for a in run.cmds[0]]
    return cmd[cmd.index("-m", cmd.index("torch.distributed.run") + 1) + 2:]


def _option(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def world_size(run) -> int:
    cmd = [str(a) for a in run.cmds[0]]
    nproc = next(a for a in cmd if a.startswith("--nproc-per-node=")).split("=")[1]
    nodes = next((a.split("=")[1] for a in cmd if a.startswith("--nnodes=")), "1")
    return int(nproc) * int(nodes.split(":")[-1])


def step_seconds(run, warmup: int = WARMUP) -> dict[int, list[tuple[int, float]]]:
    """Per attempt: (step, seconds) of every timed step after the first ``warmup`` of it."""
    args = script_args(run)
    tokens = _option(args, "--batch-size", 16) * _option(args, "--block-size", 128)
    starts: dict[int, int] = {}           # attempt -> the step it resumed from (0: a fresh start)
    out: dict[int, list[tuple[int, float]]] = {}
    last: dict[int, tuple[int, float]] = {}
    for text in run.rank_lines(0):
        r = _RESUMED.search(text)
        if r:
            starts[int(r.group(2))] = int(r.group(1))
        m = _STEP.search(text)
        if not m:
            continue
        step, attempt, tps = int(m.group(1)), int(m.group(2)), float(m.group(3))
        timed = step - starts.get(attempt, 0)
        total = timed * tokens / tps if tps else float("nan")
        prev = last.get(attempt)
        if prev is not None and prev[0] == step - 1 and timed > warmup:
            out.setdefault(attempt, []).append((step, total - prev[1]))
        last[attempt] = (step, total)
    return out


@dataclass(frozen=True)
class Throughput:
    """Tokens per second of one run: median over its timed steps, and the quartiles."""

    ranks: int
    steps: int               # steps timed (warm-up excluded)
    median: float            # tokens/s
    low: float               # 25th percentile of the per-step tokens/s
    high: float              # 75th percentile
    step_ms: float           # median step time

    def __str__(self) -> str:
        return (f"{self.ranks} rank(s): {self.median:,.0f} tok/s (quartiles {self.low:,.0f}-"
                f"{self.high:,.0f}) over {self.steps} steps, median step {self.step_ms:.1f} ms")


def throughput(run, warmup: int = WARMUP) -> Throughput:
    """The run's throughput from rank 0's log (see the module docstring for the method)."""
    args = script_args(run)
    tokens = _option(args, "--batch-size", 16) * _option(args, "--block-size", 128)
    seconds = [s for steps in step_seconds(run, warmup).values() for _, s in steps if s > 0]
    if len(seconds) < 3:
        raise ValueError(f"only {len(seconds)} timed steps in this run (log every step with "
                         f"--log-every 1, and run more than {warmup + 3} steps per attempt)")
    rates = sorted(tokens / s for s in seconds)
    q = statistics.quantiles(rates, n=4)
    return Throughput(world_size(run), len(rates), tokens / statistics.median(seconds), q[0],
                      q[2], 1000 * statistics.median(seconds))


def sample(run) -> str:
    """The text rank 0 generated at the end (``--sample-tokens``), "" if there is none."""
    lines = run.rank_lines(0)
    if "sample:" not in lines:
        return ""
    start = lines.index("sample:") + 1
    end = lines.index("[end of sample]", start) if "[end of sample]" in lines[start:] else None
    return "\n".join(lines[start:end])


def plot_throughput(results: list[Throughput], ax=None):
    """Median tokens/s per rank count, the quartiles as error bars."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3.2))
    xs = [str(r.ranks) for r in results]
    ys = [r.median for r in results]
    err = [[r.median - r.low for r in results], [r.high - r.median for r in results]]
    ax.bar(xs, ys, yerr=err, capsize=6, color=["#4C72B0", "#DD8452", "#55A868"][:len(xs)])
    for x, r in zip(xs, results):
        ax.annotate(f"{r.median:,.0f}", (x, r.median), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set(xlabel="ranks", ylabel="tokens / s (median, quartiles)",
           title="throughput per rank count (same global batch)")
    return ax
