"""Timing done right, on a machine that is never quiet (notebook 07 §2 "Timing done right").

The rules, each one a helper here:

* **warm up** first: the first steps pay for allocations, lazy imports and caches;
* **barrier before and after** the timed region, so every rank starts together and the
  step ends when the *slowest* rank ends (:func:`slowest`: a data-parallel step is as slow as
  its slowest rank);
* **paired, alternating runs** (:func:`alternating`): the things compared run next to each
  other, in order A B C, then C B A, ... so a drift in the machine's load (other programs, CPU
  frequency, a cache warming up) hits every variant alike instead of the first one;
* report the **median with its spread** (:func:`summary`), never one number.

Pure Python: these run in the notebook and inside ranks alike.
"""
from __future__ import annotations

import statistics
from typing import Sequence, TypeVar

__all__ = ["alternating", "slowest", "slowest_runs", "summary", "ratio_summary", "fmt_spread",
           "step_spread", "JOB_DEADLINE"]

# The measurements run with lk.run's default process-group timeout, so they share the
# notebook's warm ranks (a different timeout is a different pool of ranks), and with a wall-clock
# deadline generous enough for a loaded machine.
JOB_DEADLINE = 180.0

T = TypeVar("T")


def alternating(variants: Sequence[T], rounds: int) -> list[list[T]]:
    """The order of each round: forward, backward, forward ... (``rounds`` lists).

    >>> alternating(["a", "b", "c"], 3)
    [['a', 'b', 'c'], ['c', 'b', 'a'], ['a', 'b', 'c']]
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}.")
    return [list(variants) if i % 2 == 0 else list(reversed(variants)) for i in range(rounds)]


def slowest(per_rank: Sequence[float]) -> float:
    """The step time of a synchronous job: the slowest rank's."""
    return max(per_rank)


def slowest_runs(per_rank: Sequence[Sequence[float]], skip: int = 0) -> list[float]:
    """Run i's time = the slowest rank's time of run i (``per_rank[r][i]``), from run ``skip``.

    >>> slowest_runs([[1.0, 2.0, 3.0], [1.5, 1.0, 4.0]], skip=1)
    [2.0, 4.0]
    """
    runs = min(len(times) for times in per_rank)
    return [max(times[i] for times in per_rank) for i in range(skip, runs)]


def summary(samples: Sequence[float]) -> dict:
    """``{"median", "min", "max", "spread" (= (max - min) / median), "n"}``."""
    if not samples:
        raise ValueError("no samples to summarise")
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples), "n": len(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0}


def ratio_summary(numerators: Sequence[float], denominators: Sequence[float]) -> dict:
    """Summary of the paired ratios ``num[i] / den[i]`` (one pair per round)."""
    if len(numerators) != len(denominators):
        raise ValueError("paired samples must come in pairs: one of each per round")
    return summary([a / b for a, b in zip(numerators, denominators)])


def fmt_spread(s: dict, scale: float = 1.0, digits: int = 2) -> str:
    """``"12.3 (11.9-13.0)"``: the median and the range of a :func:`summary`."""
    return (f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-"
            f"{s['max'] * scale:.{digits}f})")


def step_spread(row: dict) -> str:
    """``"(11.9-13.0)"``: a table row's ``step_spread`` (min, max), in its own unit."""
    low, high = row["step_spread"]
    return f"({low:.1f}-{high:.1f})"
