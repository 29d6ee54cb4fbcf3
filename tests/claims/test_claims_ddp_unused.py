"""Claim test: what torch 2.13.0's DDP does with unused parameters (gloo, real ranks).

The sentence it backs is in notebook 02's pitfalls; labkit's BucketedDDP does the same
(tests/ddp/test_ddp_matches_torch.py).
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

import labkit as lk

import _claims

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
    """02 "Common pitfalls": “With it (torch 2.13), a parameter that no rank used keeps `.grad`
    at `None`, so the optimizer leaves it alone; one that this rank did not use but another did
    gets the average over all ranks, this rank contributing zeros.”"""
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


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
