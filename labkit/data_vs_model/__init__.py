"""Notebook 01 — data parallelism vs model parallelism, measured on real ranks.

* :mod:`~labkit.data_vs_model.drift` — replicas drifting apart without communication (§1);
* :mod:`~labkit.data_vs_model.pipeline` — one model split over two ranks, its bubble (§3);
* :mod:`~labkit.data_vs_model.memory` — memory per rank from real parameter counts (§4);
* :mod:`~labkit.data_vs_model.check` — the exercise checker.

``lk.data_vs_model.X`` reaches the names below.
"""
from ..common.models import mlp
from .drift import replica_drift
from .memory import BYTES_PER_PARAM, DDP_BUCKET_BYTES, gpt_like, memory_table, split_layers
from .pipeline import pipeline

__all__ = ["replica_drift", "pipeline", "mlp", "gpt_like", "split_layers", "memory_table",
           "BYTES_PER_PARAM", "DDP_BUCKET_BYTES"]
