"""What torch 2.13's DistributedDataParallel does with buffers, which labkit's DDPs mirror.

labkit/ddp/naive.py, ReplicatedModule: a forward first copies rank 0's buffers into every rank
when the forward before it ran with gradients enabled and outside ``no_sync`` (and the first
forward always), as torch does (torch/nn/parallel/distributed.py: ``require_forward_param_sync``
is set at the end of each forward). :func:`buffer_job` and :func:`synced` are shared with
tests/ddp/test_ddp_matches_torch.py, which holds NaiveDDP and BucketedDDP to the same rule.
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
