"""PyTorch's own: DDP, ``ZeroRedundancyOptimizer`` and FSDP2 ``fully_shard`` (notebook 06 §1, §8).

Three setups with the same protocol as :class:`labkit.sharding.zero.HandZero` (``module``,
``step()``, ``zero_grad()``, ``memory()``, ``full_parameters()``), so the harness trains,
counts and measures them all the same way:

* :class:`TorchDDP` — ``DistributedDataParallel`` + ``torch.optim.Adam``: the baseline.
* :class:`TorchZeroRedundancy` — DDP + ``ZeroRedundancyOptimizer(optimizer_class=Adam)``: ZeRO-1
  as torch ships it. It partitions whole *parameters* (not elements) among the ranks, and it
  relies on DDP's all-reduce, then **broadcasts** each updated parameter from its owner.
* :class:`TorchFSDP` — ``fully_shard`` on every ``nn.Linear`` and on the root, over a device
  mesh made explicitly on the CPU (``init_device_mesh("cpu", (N,))``: with a default gloo group
  on a machine that has a GPU, FSDP2 moves to CUDA — pytorch/pytorch#132471).
  ``reshard_after_forward=True`` frees each layer's gathered parameters after its forward and
  gathers them again in backward (ZeRO-3); ``False`` keeps them until backward is done
  (parameters unsharded between forward and backward, like ZeRO-2: no second all-gather).

Memory is read from storages; for DTensors (FSDP2's parameters, gradients and Adam state) from
the local shard's storage.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.naive import broadcast_parameters
from .memory import _bucket_recorder, optimizer_tensors, storage_bytes

__all__ = ["TorchDDP", "TorchZeroRedundancy", "TorchFSDP", "cpu_mesh"]


def cpu_mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None):
    """A device mesh on the CPU over all ranks (``init_device_mesh("cpu", shape)``)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape or (dist.get_world_size(),), mesh_dim_names=names)


class _DDPBase:
    def __init__(self, model: nn.Module, bucket_cap_mb: float) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.inner = model
        self.module = DDP(model, bucket_cap_mb=bucket_cap_mb)     # broadcasts rank 0's weights
        self.buffers: dict = {}
        self.module.register_comm_hook(None, _bucket_recorder(self.buffers))

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        for p in self.inner.parameters():
            p.grad = None
        # DDP rebuilds its buckets after the first iteration: keep only the latest step's
        self.buffers.clear()

    def memory(self) -> dict[str, int]:
        params = list(self.inner.parameters())
        return {"params": storage_bytes(params),
                "grads": storage_bytes([p.grad for p in params], exclude=self.buffers.values()),
                "optimizer": storage_bytes(optimizer_tensors(self.opt)),
                "buckets": storage_bytes(self.buffers.values()), "transient": None}

    def full_parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.inner.parameters()]


class TorchDDP(_DDPBase):
    """``DistributedDataParallel`` with ``torch.optim.Adam``: every rank holds everything."""

    def __init__(self, model: nn.Module, lr: float = 1e-2, bucket_cap_mb: float = 25.0) -> None:
        super().__init__(model, bucket_cap_mb)
        self.name = "DDP (torch)"
        self.opt = torch.optim.Adam(self.inner.parameters(), lr=lr)


class TorchZeroRedundancy(_DDPBase):
    """DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` over Adam (torch's ZeRO-1)."""

    def __init__(self, model: nn.Module, lr: float = 1e-2, bucket_cap_mb: float = 25.0) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        super().__init__(model, bucket_cap_mb)
        self.name = "ZeroRedundancyOptimizer"
        self.opt = ZeroRedundancyOptimizer(self.inner.parameters(),
                                           optimizer_class=torch.optim.Adam, lr=lr)


class TorchFSDP:
    """FSDP2: ``fully_shard`` on each ``nn.Linear`` and the root, ``torch.optim.Adam`` on DTensors.

    Args:
        reshard_after_forward: True (ZeRO-3: gather again in backward) or False (keep the
            gathered parameters from forward to backward).
    """

    def __init__(self, model: nn.Module, lr: float = 1e-2,
                 reshard_after_forward: bool = True) -> None:
        from torch.distributed.fsdp import fully_shard
        self.mesh = cpu_mesh()
        broadcast_parameters(model)                # fully_shard shards what each rank has
        for layer in [m for m in model.modules() if isinstance(m, nn.Linear)]:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        self.module = fully_shard(model, mesh=self.mesh,
                                  reshard_after_forward=reshard_after_forward)
        self.name = f"FSDP2 fully_shard (reshard_after_forward={reshard_after_forward})"
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        params = list(self.module.parameters())
        return {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
                "optimizer": storage_bytes(optimizer_tensors(self.opt)), "buckets": 0,
                "transient": None}          # FSDP2's gather buffers are internal: not measured

    def full_parameters(self) -> list[torch.Tensor]:
        return [p.detach().full_tensor() for p in self.module.parameters()]
