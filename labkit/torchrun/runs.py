"""Reading the training script's runs under torchrun: losses per attempt, where each resumed.

:mod:`labkit.torchrun.train`'s rank 0 logs ``step N/M | epoch E | loss L | attempt A`` and, after a
restart, ``resumed from <snapshot>: step N, ...``. These functions read those lines out of a
:class:`~labkit.runtime.torchrun.log.Run` (what ``lk.torchrun.run``/``job.wait()`` return) for
notebook 05 ("Launch it, kill it, watch it resume" and "An exception, then a SIGKILL: the whole
log").

Example::

    run = lk.torchrun.run("labkit.torchrun.train", [...], max_restarts=2)
    lk.torchrun.resumes(run)        # [16, 40]: the step each restarted attempt resumed from
    lk.torchrun.plot_losses(run)
"""
from __future__ import annotations

import re

from ..runtime.torchrun.log import Run
from .train import parse_log

__all__ = ["losses", "resumes", "plot_losses"]

_RESUMED = re.compile(r"^resumed from .*: step (\d+)")


def losses(run: Run) -> list[tuple[int, float, int]]:
    """(step, loss, attempt) from the rank-0 log lines of the training script."""
    return parse_log(run.rank_lines())


def resumes(run: Run) -> list[int]:
    """The step each resumed attempt started from (``resumed from ...: step N`` lines)."""
    return [int(m.group(1)) for m in map(_RESUMED.search, run.rank_lines()) if m]


def plot_losses(run: Run, ax=None, title: str = "one training run, three attempts"):
    """Loss per step, one colour per attempt; where each attempt died and where the next resumed.

    Re-done steps are drawn on top of each other (big marker: first attempt, smaller:
    later ones): identical losses show as one point.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    points = losses(run)
    attempts = sorted({a for _, _, a in points})
    starts = resumes(run)
    for attempt in attempts:
        steps = [s for s, _, a in points if a == attempt]
        resumed = starts[attempt - 1] if 0 < attempt <= len(starts) else None
        line, = ax.plot(steps, [v for _, v, a in points if a == attempt], "o-",
                        ms=max(3.0, 9.0 - 3 * attempt), lw=1.5, alpha=0.85,
                        label=f"attempt {attempt}" + (f", resumed at step {resumed}"
                                                      if resumed is not None else ""))
        if resumed is not None:
            ax.axvline(resumed, color=line.get_color(), ls=":", lw=1.5)
        if attempt != attempts[-1]:
            ax.axvline(steps[-1], color="grey", ls="--", lw=1)
            ax.annotate(f"attempt {attempt} dies", (steps[-1], ax.get_ylim()[1]), fontsize=8,
                        ha="left", va="top", xytext=(3, -3), textcoords="offset points")
    ax.set(xlabel="optimizer step", ylabel="training loss (mean over ranks)", title=title)
    ax.legend(loc="upper right", fontsize=8)
    return ax
