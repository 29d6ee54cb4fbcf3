"""Break it, see it, fix it: the harness every pitfall scenario of notebook 04 runs in.

Each scenario is a rank function with its bug marked ``# BUG`` (and the fix, ``fixed=True`` or
a mode, marked ``# FIX``) plus a runner that runs it with ``lk.run`` on real gloo ranks with
short timeouts (seconds) and returns an :class:`Outcome`: the real
:class:`~labkit.runtime.result.JobResult`, the error the learner would get, and
:func:`labkit.diagnosis.diagnose`'s verdict. Nothing raises and no rank outlives its job.
:func:`scenario_fn` registers a rank function so that ``lk.pitfalls.show(name)`` can print it.
The scenarios live in :mod:`labkit.pitfalls.collective_faults`,
:mod:`labkit.pitfalls.divergence` and :mod:`labkit.pitfalls.staleness`.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable

from ..diagnosis import Verdict, diagnose
from ..runtime import JobFailed, JobResult, run

__all__ = ["Outcome", "scenario", "scenario_fn", "show", "RANK_FNS"]


@dataclass(repr=False)
class Outcome:
    """What a scenario did: ``result`` (per rank), ``error`` (as lk.run raised it), ``verdict``."""

    name: str
    result: JobResult
    error: JobFailed | None
    verdict: Verdict
    seconds: float

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def surfaced_s(self) -> float | None:
        """Seconds from the ranks starting the job to its first failure (None: nothing failed).

        Process start-up is not counted; a pure hang (no rank reports) counts the whole job.
        """
        if self.result.ok:
            return None
        walls = [r.wall_s for r in self.result.ranks if not r.ok and r.wall_s is not None]
        return min(walls) if walls else self.seconds

    def __repr__(self) -> str:
        head = (f"{self.name}: ranks returned {self.result.values!r:.300}" if self.error is None
                else f"{self.name}: {type(self.error).__name__} after {self.seconds:.1f} s\n"
                     f"{str(self.error).strip()}")
        return f"{head}\n\n{self.verdict}"


def scenario(name: str, fn: Callable, world_size: int = 2, *, timeout: float = 2.0,
             env: dict | None = None, backend: str = "gloo", deadline: float | None = None,
             echo: bool = False, **kwargs) -> Outcome:
    """Run ``fn`` on ``world_size`` ranks and diagnose whatever happened.

    The job never raises: a failure is in ``Outcome.error`` (the exception
    ``lk.run`` raised) and ``Outcome.verdict``. Every rank is gone afterwards.
    """
    t0 = time.perf_counter()
    try:
        res, err = run(fn, world_size, kwargs=kwargs, timeout=timeout, env=env,
                       backend=backend, deadline=deadline, echo=echo), None
    except JobFailed as exc:
        res, err = exc.result, exc
    return Outcome(name, res, err, diagnose(res), time.perf_counter() - t0)


RANK_FNS: dict[str, Callable] = {}   # scenario name -> its rank function (for show)


def scenario_fn(fn: Callable) -> Callable:
    """Register a scenario's rank function under its name (``_late_rank_step`` -> ``late_rank``)."""
    RANK_FNS[fn.__name__.lstrip("_").removesuffix("_step")] = fn
    return fn


def show(name: str) -> str:
    """Print the rank function of scenario ``name`` (its bug is marked ``# BUG``).

    The scenario modules register their functions when imported (``lk.pitfalls`` imports all).
    """
    if name not in RANK_FNS:
        raise KeyError(f"no scenario {name!r}; choose one of {', '.join(sorted(RANK_FNS))}")
    src = inspect.getsource(RANK_FNS[name])
    print(src)
    return src
