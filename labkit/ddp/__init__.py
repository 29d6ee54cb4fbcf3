"""Notebook 02 — DDP step by step: by hand (naive, then bucketed and overlapped), then torch's.

* :mod:`~labkit.ddp.naive` — replicate (broadcast), average every gradient, :class:`NaiveDDP`;
* :mod:`~labkit.ddp.bucketed` — :class:`BucketedDDP`: buckets launched during backward;
* :mod:`~labkit.ddp.overlap` — overlap and bucket size, measured on real ranks (``lk.overlap``);
* :mod:`~labkit.ddp.check` — the exercise checkers (average_gradients, the DDP wrapper).

``lk.ddp.X`` reaches the names below; ``device`` and ``checksum`` live in
:mod:`labkit.common.ranks` (every later lesson calls them too).
"""
from ..common.ranks import checksum, device
from .bucketed import BucketedDDP, assign_buckets
from .naive import NaiveDDP, ReplicatedModule, average_gradients, broadcast_parameters

__all__ = ["device", "checksum", "broadcast_parameters", "average_gradients", "assign_buckets",
           "ReplicatedModule", "NaiveDDP", "BucketedDDP"]
