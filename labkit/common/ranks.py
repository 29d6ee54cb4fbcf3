"""Helpers every lesson calls inside its ranks: the rank's device, a replica checksum.

Defined once, below the lessons (notebook 02 introduces both: ``lk.ddp.device`` and
``lk.ddp.checksum`` are these functions).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["device", "checksum", "require_process_group"]


def uses_nccl(group=None) -> bool:
    """Whether ``group`` (default: the default group) runs CUDA tensors on NCCL: a plain
    ``"nccl"`` group, or a device-mapped one such as ``"cpu:gloo,cuda:nccl"``."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend(group))


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` when the process group runs CUDA tensors on
    NCCL (:func:`uses_nccl`), else CPU."""
    if uses_nccl():
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def checksum(module: nn.Module) -> float:
    """Sum of every parameter, in float64. Different sums prove replicas differ; equal sums do not
    prove they agree (errors can cancel): :func:`labkit.diagnosis.fingerprint` compares each
    tensor."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in module.parameters()))


def require_process_group(what: str) -> None:
    """Raise a helpful error when ``what`` is called outside a rank (no process group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised, and here it is not (this is the "
            f"notebook's own process, not a rank). Call it inside a function you run with "
            f"lk.run(fn, world_size=...), or after dist.init_process_group() under torchrun.")
