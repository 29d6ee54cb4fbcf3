"""Where DDP's memory goes, read from the tensors' storages (notebook 06 §1).

A tensor is a view of a *storage*, the block of memory that really holds the numbers; two
tensors can share one (a gradient that is a view into DDP's bucket, a parameter that is a view
into a flat buffer). :func:`storage_bytes` adds up the distinct storages behind a set of
tensors, so nothing is counted twice and nothing hidden in a small view escapes: what it
reports is what the rank holds.

:func:`ddp_memory` runs one DDP + Adam step in a rank and measures each part: parameters,
gradients, Adam's state and DDP's gradient buckets (seen by a communication hook that records
each bucket's flat buffer). With ``gradient_as_bucket_view=True`` the gradients *are* views into
the buckets, and the storage count shows the copy disappear.

Example::

    res = lk.run(lk.sharding.memory.ddp_memory, 2)
    res.values[0]["measured"]     # {'params': 29248, 'grads': 29248, 'optimizer': 58520, ...}
"""
from __future__ import annotations

from typing import Iterable

import torch

from .calculator import memory_per_rank
from .model import DIMS, make_mlp, numel, rank_batch

__all__ = ["local", "storage_key", "storage_bytes", "reachable_tensors", "optimizer_tensors",
           "ddp_memory", "PARTS"]

PARTS = ("params", "grads", "optimizer", "buckets")


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``t``: a DTensor's local shard, else ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the storage behind ``t`` (device and address)."""
    s = local(t).untyped_storage()
    return (str(s.device), s.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor | None],
                  exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped), minus ``exclude``'s."""
    skip = {storage_key(t) for t in exclude if t is not None}
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        key = storage_key(t)
        if key not in skip and key[1] != 0:          # data_ptr 0: a freed (resized-to-0) storage
            seen[key] = local(t).untyped_storage().nbytes()
    return sum(seen.values())


def reachable_tensors(obj, depth: int = 6) -> list[torch.Tensor]:
    """Every tensor an object holds: attributes, containers, optimizer state, nested objects.

    Used by the exercise checkers to see what a learner's optimizer or wrapper keeps between
    steps, whatever it calls its attributes. Modules, functions and classes are walked only
    through their instance attributes; the walk stops ``depth`` levels down.
    """
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(o, d: int) -> None:
        if id(o) in seen or d < 0 or isinstance(o, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
            if o.grad is not None:
                walk(o.grad, d - 1)
            return
        if isinstance(o, dict):
            for k, v in o.items():
                walk(k, d - 1)
                walk(v, d - 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v, d - 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o) or \
                isinstance(o, torch.nn.Module):
            for v in vars(o).values():
                walk(v, d - 1)

    walk(obj, depth)
    return found


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    inner = getattr(opt, "optim", None)            # ZeroRedundancyOptimizer's local optimizer
    state = (inner if inner is not None else opt).state
    return [v for per_param in state.values() for v in per_param.values()
            if isinstance(v, torch.Tensor)]


def _bucket_recorder(buffers: dict):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):                     # DDP calls it with each bucket's flat buffer
        buf = bucket.buffer()
        buffers[storage_key(buf)] = buf
        return allreduce_hook(state, bucket)
    return hook


def ddp_memory(rank: int, world_size: int, dims: tuple[int, ...] = DIMS,
               bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = False,
               optimizer: str = "adam") -> dict:
    """(In a rank) one step of torch DDP + ``torch.optim.Adam`` (``optimizer="sgd"``:
    ``torch.optim.SGD`` with momentum 0.9); bytes of each part, measured.

    Returns ``psi``, ``measured`` (``params``, ``grads``, ``optimizer``, ``buckets``, ``total``:
    distinct storages, a gradient that lives inside a bucket counted once), ``formula``
    (:func:`labkit.sharding.calculator.memory_per_rank`, whose optimizer state is Adam's 8Ψ;
    SGD's momentum is 4Ψ), ``buckets`` (how many) and ``grads_in_buckets`` (whether every
    gradient shares a bucket's storage).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
    model = make_mlp(dims, seed=0)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view)
    buffers: dict = {}
    ddp.register_comm_hook(None, _bucket_recorder(buffers))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    x, y = rank_batch(rank, world_size, dims=dims)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    bucket_keys = set(buffers)
    measured = {"params": storage_bytes(params),
                "grads": storage_bytes(grads, exclude=buffers.values()),
                "optimizer": storage_bytes(optimizer_tensors(opt)),
                "buckets": storage_bytes(buffers.values())}
    measured["total"] = storage_bytes(params + grads + optimizer_tensors(opt)
                                      + list(buffers.values()))
    psi = numel(model)
    formula = memory_per_rank(psi, world_size, "DDP")
    if optimizer == "sgd":                       # one momentum buffer per element, no step count
        formula["optimizer"] = 4.0 * psi
        formula["total"] = sum(v for k, v in formula.items() if k != "total")
    return {"psi": psi, "world_size": world_size, "measured": measured, "formula": formula,
            "optimizer": optimizer,
            "buckets": len(buffers),
            "grads_in_buckets": all(storage_key(g) in bucket_keys for g in grads),
            "gradient_as_bucket_view": gradient_as_bucket_view}
