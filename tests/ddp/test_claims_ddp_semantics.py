"""Claims about torch DDP's unused parameters and buffers (notebook 02, "Common pitfalls"), torch 2.13.0.

Notebook 02, "Common pitfalls", unused parameters: "With it (torch 2.13), a parameter that
no rank used keeps `.grad` at `None`, so the optimizer leaves it alone; one that this rank did
not use but another did gets the average over all ranks, this rank contributing zeros."

labkit/ddp/naive.py, ReplicatedModule: "a forward first copies rank 0's buffers ... into every
rank when the forward before it ran with gradients enabled and outside no_sync (and the first
forward always), as torch.nn.parallel.DistributedDataParallel does in torch 2.13".
"""
from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest
import torch
from torch import nn

import labkit as lk

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks cannot import this file

pytestmark = pytest.mark.timeout(120)


class Branches(nn.Module):
    """Three layers; the forward uses the one it is told to."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.never = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use):
        return getattr(self, use)(x)


def _unused_job(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = Branches()
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    ddp = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(1, 3) * (rank + 1)
    grads = []
    for uses in (("a", "b"), ("a", "a")):        # step 0: each rank its own; step 1: b unused
        opt.zero_grad()
        ddp(x, uses[rank]).sum().backward()
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in net.named_parameters()})
        opt.step()
    moved = {n: not torch.equal(p, start[n]) for n, p in net.named_parameters()}
    return grads, moved


def test_unused_everywhere_keeps_none_and_used_somewhere_is_averaged_with_zeros():
    (g0, moved0), (g1, moved1) = lk.run(_unused_job, 2, timeout=30, echo=False).values
    for rank_grads in (g0, g1):
        step0, step1 = rank_grads
        # a: used by rank 0 only (x = 1): local gradient of sum(W x + c) w.r.t. W is ones * 1
        assert torch.equal(step0["a.weight"], torch.full((3, 3), 0.5))
        # b: used by rank 1 only (x = 2)
        assert torch.equal(step0["b.weight"], torch.full((3, 3), 1.0))
        assert step0["never.weight"] is None and step0["never.bias"] is None
        assert step1["b.weight"] is None and step1["never.weight"] is None
    assert moved0 == moved1 == {"a.weight": True, "a.bias": True, "b.weight": True,
                                "b.bias": True, "never.weight": False, "never.bias": False}


SEQUENCE = ("train", "no_sync", "eval", "train", "eval")
# torch 2.13 (torch/nn/parallel/distributed.py): a forward syncs the buffers first when the
# forward before it ran with gradients on and outside no_sync (and the very first one does).
SYNCED = (True, True, False, False, True)


def buffer_job(rank, world_size, wrap=None):
    """BatchNorm under a DDP (torch's, or ``wrap``): each forward's buffers, before and after."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ddp = DDP(net) if wrap is None else wrap(net)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    means = []
    net[1].register_forward_pre_hook(lambda m, args: means.append(args[0].mean(0).detach()))
    seen = []
    for mode in SEQUENCE:
        net.train(mode != "eval")
        context = {"train": contextlib.nullcontext(), "no_sync": ddp.no_sync(),
                   "eval": torch.no_grad()}[mode]
        with context:
            before = net[1].running_mean.clone()
            out = ddp(x)
            if mode != "eval":
                out.sum().backward()
        if wrap is not None and mode == "train":
            ddp.finish_gradient_synchronization()
        seen.append({"before": before, "after": net[1].running_mean.clone(), "mean": means[-1]})
    return seen


def synced(r0: list, r1: list, momentum: float = 0.1) -> list[bool]:
    """Per forward: did rank 1 start from rank 0's buffer? (forward 0: both start equal)"""
    out = []
    for mode, a, b in zip(SEQUENCE, r0, r1):
        def expect(start):
            return start if mode == "eval" else (1 - momentum) * start + momentum * b["mean"]
        from_rank0 = torch.allclose(b["after"], expect(a["before"]), atol=1e-6)
        own = torch.allclose(b["after"], expect(b["before"]), atol=1e-6)
        assert from_rank0 != own or torch.equal(a["before"], b["before"]), "ambiguous"
        out.append(from_rank0)
    return out


def test_rank_0s_buffers_overwrite_a_forward_after_a_synced_one():
    r0, r1 = lk.run(buffer_job, 2, timeout=30, echo=False).values
    assert tuple(synced(r0, r1)) == SYNCED
