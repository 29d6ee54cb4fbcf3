"""Notebook 09 — long sequences and many experts: activation memory, sequence and context
parallelism, expert parallelism.

* :mod:`~labkit.sequences_experts.activations` — what a transformer block keeps for backward,
  measured beside the formula; activation checkpointing's memory and recompute;
* :mod:`~labkit.sequences_experts.sequence_parallel` — Megatron sequence parallelism (the norm
  and dropout regions split along the sequence, tensor parallelism's all-reduce as a
  reduce-scatter and an all-gather);
* :mod:`~labkit.sequences_experts.attention` — attention over a sequence split across ranks:
  the ring (log-sum-exp merge, load-balanced causal split) and Ulysses (all-to-all);
* :mod:`~labkit.sequences_experts.experts` — a mixture-of-experts layer, single-process and
  with experts spread over ranks (all-to-all dispatch and combine);
* :mod:`~labkit.sequences_experts.axes` — which axis when: what each split keeps and sends
  per rank, from the formulas above (§14);
* :mod:`~labkit.sequences_experts.bench` — ``python -m labkit bench sequences``;
* :mod:`~labkit.sequences_experts.check` — the checkers of the exercises.

``lk.sequences_experts.X`` reaches the modules (``SX.attention.ring_attention``, ...).
"""
from . import activations, attention, axes, experts, sequence_parallel

__all__ = ["activations", "attention", "axes", "experts", "sequence_parallel"]
