"""Notebook 04 — pitfalls: every failure really happens, is diagnosed, and is fixed.

* :mod:`~labkit.pitfalls.scenario` — the harness: :func:`scenario`, :class:`Outcome`, ``show``;
* :mod:`~labkit.pitfalls.collective_faults` — hangs, mismatched collectives, silent wrong sums,
  size mismatches, crashed ranks, the flight recorder, a mystery hang;
* :mod:`~labkit.pitfalls.divergence` — gradient mismatch: no sync, unused parameters, data
  sharding, BatchNorm statistics, gradient accumulation, uneven inputs;
* :mod:`~labkit.pitfalls.staleness` — an asynchronous parameter server, a delay-k simulation;
* :mod:`~labkit.pitfalls.nccl_faults` / :mod:`~labkit.pitfalls.nccl_capture` — NCCL's failures
  on GPUs, live or as captured logs (§9);
* :mod:`~labkit.pitfalls.check` — the exercise checkers and quiz keys.

Notebooks use ``P = lk.pitfalls``: ``P.late_rank()``, ``P.show("late_rank")``.
"""
from ..common.ranks import device
from .collective_faults import *  # noqa: F401,F403  (the scenarios, one namespace)
from .collective_faults import __all__ as _faults
from .divergence import *  # noqa: F401,F403
from .divergence import __all__ as _divergence
from .scenario import Outcome, scenario, show
from .staleness import *  # noqa: F401,F403
from .staleness import __all__ as _staleness

__all__ = ["Outcome", "scenario", "show", "device", *_faults, *_divergence, *_staleness]
