"""Break it, see it, fix it: the scenarios of the pitfalls lab, real failures on real ranks (nb 04).

Each scenario is a rank function with its bug marked ``# BUG`` (and the fix,
``fixed=True`` or a mode, marked ``# FIX``) plus a runner that runs it with
``lk.run`` on real gloo ranks with short timeouts (seconds) and returns an
:class:`Outcome`: the real :class:`~labkit.result.JobResult`, the error the
learner would get, and :func:`labkit.diagnosis.diagnose`'s verdict. Nothing
raises and no rank outlives its job.
``show(name)`` prints a scenario's rank function. This module is the harness;
the scenarios live in three modules, one concept each, and are re-exported
here (``lk.pitfalls.late_rank()``):

* :mod:`labkit.collective_faults` - hangs, mismatched collectives, silent wrong
  sums, size mismatches, crashed ranks, the flight recorder, a mystery hang;
* :mod:`labkit.divergence` - gradient mismatch: no sync, unused parameters, data
  sharding, BatchNorm statistics, gradient accumulation, uneven inputs;
* :mod:`labkit.staleness` - an asynchronous parameter server and a delay-k simulation.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable

from .diagnosis import diagnose
from .errors import JobFailed
from .launch import run
from .result import JobResult
from .verdict import Verdict

# Example:
#     out = lk.pitfalls.skipped_collective()      # rank 1 skips an all_reduce
#     out.verdict.kind, out.verdict.culprits       # ('missing_rank', [1])
#     lk.pitfalls.skipped_collective(fixed=True).ok   # True

__all__ = ["Outcome", "scenario", "show", "device"]
_MODULES = ("collective_faults", "divergence", "staleness")


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


def device():
    """This rank's device: ``cuda:<rank>`` under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


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


_RANK_FNS: dict[str, Callable] = {}


def _scenario_fn(fn: Callable) -> Callable:
    _RANK_FNS[fn.__name__.lstrip("_").removesuffix("_step")] = fn
    return fn


def show(name: str) -> str:
    """Print the rank function of scenario ``name`` (its bug is marked ``# BUG``)."""
    _load()  # registers every scenario

    if name not in _RANK_FNS:
        raise KeyError(f"no scenario {name!r}; choose one of {', '.join(sorted(_RANK_FNS))}")
    src = inspect.getsource(_RANK_FNS[name])
    print(src)
    return src


def _load():
    import importlib

    return [importlib.import_module(f"{__package__}.{m}") for m in _MODULES]


def __getattr__(name: str):
    # The scenarios, re-exported so notebooks need only lk.pitfalls.
    for mod in _load():
        if name in mod.__all__:
            return getattr(mod, name)
    raise AttributeError(f"module 'labkit.pitfalls' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for m in _load() for n in m.__all__})
