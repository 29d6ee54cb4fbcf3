"""Notebook 03 — ring all-reduce: how gradients get summed across ranks.

* :mod:`~labkit.collectives.allreduce` — the naive (master) and the chunked ring all-reduce,
  written by hand with ``isend``/``irecv`` (§3), their byte counts, :func:`record` (one traced
  run on real ranks);
* :mod:`~labkit.collectives.trace` — every message and every chunk's value, per step;
* :mod:`~labkit.collectives.player` — the ring player drawn from a real trace
  (``lk.ringviz.player``);
* :mod:`~labkit.collectives.bandwidth` — measured bandwidth, the α–β model and its labelled
  prediction (``lk.bandwidth``, ``python -m labkit bench allreduce``);
* :mod:`~labkit.collectives.check` — the checkers of the §2 build (one reduce-scatter step,
  :mod:`~labkit.collectives.check.step`) and of the §7 exercise (its
  :mod:`~labkit.collectives.check.cases`: the exercise's tensors and the job each rank runs on them).

``lk.collectives.X`` reaches the names below.
"""
from .allreduce import (check_traffic, expected_traffic, naive_all_reduce, naive_master_bytes,
                        powers_of_ten, record, ring_all_reduce, ring_bytes_per_rank,
                        ring_schedule, send_right_recv_left)
from .check import CASES, check_reduce_scatter_step, check_ring_exercise
from .trace import RankTrace, Trace, tracing

__all__ = ["ring_all_reduce", "naive_all_reduce", "send_right_recv_left", "ring_schedule",
           "expected_traffic", "ring_bytes_per_rank", "naive_master_bytes", "check_traffic",
           "record", "powers_of_ten", "check_ring_exercise", "check_reduce_scatter_step", "CASES",
           "RankTrace", "Trace", "tracing"]
