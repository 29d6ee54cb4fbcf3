"""The ring's two halves as collectives of their own: reduce-scatter and all-gather (notebook 06 §3).

Notebook 03's ring all-reduce is N-1 steps of *reduce-scatter* followed by N-1 steps of
*all-gather*. Stopped half-way, it is exactly what sharded training needs:

* :func:`ring_reduce_scatter` — every rank passes a chunk to its right neighbour and adds the
  one from its left; after N-1 steps rank r holds the **sum of chunk r** over all ranks (the
  schedule is notebook 03's, shifted one chunk so that rank r ends with chunk r, its shard).
* :func:`ring_all_gather` — rank r starts with chunk r; N-1 steps pass the chunks around until
  every rank holds all of them.

Each sends (N-1)/N·S bytes per rank for a tensor of S bytes: half of the all-reduce's
2(N-1)/N·S. ZeRO-3 does two all-gathers and one reduce-scatter per step where DDP does one
all-reduce (two halves): 3 halves against 2, the "1.5×".

Both take a 1-D tensor whose length the world size divides (pad it: :class:`labkit.sharding.zero.FlatLayout`)
and use only ``isend``/``irecv`` (``batch_isend_irecv`` on NCCL).

Example (inside a rank)::

    flat = torch.arange(8.0) * (rank + 1)
    mine = ring_reduce_scatter(flat)       # rank r: sum over ranks of flat.chunk(N)[r]
    full = ring_all_gather(mine)           # == the all-reduced flat, on every rank
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..grading.references import reference

__all__ = ["ring_reduce_scatter", "ring_all_gather"]


def _check(flat: torch.Tensor, who: str) -> int:
    if not dist.is_initialized():
        raise RuntimeError(f"{who} talks to other ranks, but no process group is initialised in "
                           f"this process. Call it inside a function run by lk.run(...).")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{who} needs a contiguous 1-D tensor, got "
                         f"{type(flat).__name__} of shape {tuple(getattr(flat, 'shape', ()))}: "
                         f"flatten it (FlatLayout.flatten pads it too).")
    return dist.get_world_size()


def _swap(send: torch.Tensor, right: int, recv: torch.Tensor, left: int) -> None:
    """Send to the right neighbour and receive from the left one at the same time."""
    if send.is_cuda:        # NCCL: two lone isends can wait for each other
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),
                                        dist.P2POp(dist.irecv, recv, left)])
    else:
        works = [dist.isend(send, right), dist.irecv(recv, left)]
    for w in works:
        w.wait()


@reference
def ring_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """Sum ``flat`` over all ranks and return this rank's chunk of the sum (a new tensor).

    ``flat`` is left unchanged. Rank r gets ``sum over ranks of flat.chunk(N)[r]``, like
    ``dist.reduce_scatter_single`` with ``ReduceOp.SUM``.
    """
    n = _check(flat, "ring_reduce_scatter")
    if flat.numel() % n:
        raise ValueError(f"ring_reduce_scatter: {flat.numel()} elements do not split into "
                         f"{n} equal chunks; pad to a multiple of {n} (FlatLayout does).")
    rank = dist.get_rank()
    chunks = [c.clone() for c in flat.chunk(n)] if n > 1 else [flat.clone()]
    right, left = (rank + 1) % n, (rank - 1) % n
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        # notebook 03 sends chunk (r - s) and ends with chunk r + 1; one chunk earlier ends at r
        _swap(chunks[(rank - s - 1) % n], right, buf, left)
        chunks[(rank - s - 2) % n] += buf
    return chunks[rank]


@reference
def ring_all_gather(shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate every rank's ``shard`` in rank order, on every rank; returns the full tensor.

    ``out`` (length N·len(shard)) receives the result in place when given, e.g. a flat
    parameter buffer whose chunk r already is this rank's shard.
    """
    n = _check(shard, "ring_all_gather")
    rank = dist.get_rank()
    if out is None:
        out = shard.new_empty(n * shard.numel())
    if out.numel() != n * shard.numel():
        raise ValueError(f"ring_all_gather: out has {out.numel()} elements, expected "
                         f"{n} x {shard.numel()} = {n * shard.numel()}.")
    chunks = out.chunk(n)
    if chunks[rank].data_ptr() != shard.data_ptr():
        chunks[rank].copy_(shard)
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        _swap(chunks[(rank - s) % n], right, chunks[(rank - s - 1) % n], left)
    return out
