"""BucketedDDP against torch DDP(find_unused_parameters=True), every rank, every step (issue 14).

The model has every trap at once: a parameter used on some ranks only, one used on no rank in
a step (and one never used), a frozen layer, a tied weight, BatchNorm buffers, a momentum
optimizer (which keeps moving a parameter that is handed a zero gradient instead of none) and
a gradient-accumulation step under ``no_sync``. Before the fix BucketedDDP gave a parameter
unused on every rank a zero gradient, and momentum moved it away from torch's.
"""
from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest
import torch
from torch import nn

import labkit as lk
from labkit.ddp import BucketedDDP, NaiveDDP

from test_torch_ddp_semantics import SYNCED, buffer_job, synced

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks cannot import this file

pytestmark = pytest.mark.timeout(180)

# per step, the branch each rank takes (rank r reads [r]); a list = micro-batches, no_sync first
SCHEDULE = [
    ("a", "b", "a"),                     # a, b each used on some ranks; `never` on none
    ("a", "a", "a"),                     # b used on no rank: its .grad must stay None
    ("none", "b", "none"),               # a used on no rank, b on one
    [("b", "none", "b"), ("a", "a", "a")],   # accumulation: b only in the no_sync micro-batch
]


class Traps(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.bn = nn.BatchNorm1d(4)
        self.a, self.b, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.shared.weight            # tied

    def forward(self, x, use):
        h = self.bn(torch.tanh(self.frozen(self.shared(x))))
        if use != "none":
            h = getattr(self, use)(h)
        return self.out(torch.tanh(h))


def _train(rank, world_size, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from labkit.ddp.check.oracle import state_of
    torch.manual_seed(rank)                             # different inits: step 1 must fix them
    net = Traps()
    wrap = {"torch": lambda m: DDP(m, find_unused_parameters=True),
            "one per tensor": lambda m: BucketedDDP(m, bucket_cap_mb=0),
            "small buckets": lambda m: BucketedDDP(m, bucket_cap_mb=0.0001),
            "one bucket": lambda m: BucketedDDP(m, bucket_cap_mb=25)}[variant]
    ddp = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    history = []
    for step, plan in enumerate(SCHEDULE):
        micro = plan if isinstance(plan, list) else [plan]
        opt.zero_grad()
        for i, uses in enumerate(micro):
            last = i == len(micro) - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                x = torch.randn(6, 4, generator=g)
                (ddp(x, uses[rank]).pow(2).mean() / len(micro)).backward()
        if variant != "torch":
            ddp.finish_gradient_synchronization()
        history.append({"grads": {n: None if p.grad is None else p.grad.clone()
                                  for n, p in net.named_parameters()}})
        opt.step()
        history[-1]["state"] = state_of(net)
    return {"history": history, "buckets": getattr(ddp, "buckets", None)}


@pytest.mark.slow   # torch DDP and torch.optim import torch._dynamo in fresh ranks: seconds
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_ddp_matches_torch_ddp_on_every_rank_at_every_step(world_size):
    want = lk.run(_train, world_size, args=("torch",), timeout=30, echo=False).values
    for variant in ("one per tensor", "small buckets", "one bucket"):
        got = lk.run(_train, world_size, args=(variant,), timeout=30, echo=False).values
        if variant == "small buckets":
            assert len(got[0]["buckets"]) >= 3, got[0]["buckets"]
        for rank in range(world_size):
            for step, (g, w) in enumerate(zip(got[rank]["history"], want[rank]["history"])):
                where = f"{variant}, rank {rank}, step {step}"
                for name, wg in w["grads"].items():
                    if wg is None:
                        assert g["grads"][name] is None, f"{where}: {name}.grad should be None"
                    else:
                        torch.testing.assert_close(g["grads"][name], wg, atol=1e-6, rtol=1e-5,
                                                   msg=f"{where}: {name}.grad")
                for name, ws in w["state"].items():
                    torch.testing.assert_close(g["state"][name], ws, atol=1e-6, rtol=1e-5,
                                               msg=f"{where}: {name} after the step")
    # the schedule does what it says, in torch: unused on every rank -> None
    steps = want[0]["history"]
    assert steps[0]["grads"]["never.weight"] is None and steps[1]["grads"]["b.weight"] is None
    assert steps[2]["grads"]["a.weight"] is None and steps[3]["grads"]["b.weight"] is not None
    assert steps[0]["grads"]["frozen.weight"] is None


@pytest.mark.parametrize("wrap", [NaiveDDP, lambda m: BucketedDDP(m, bucket_cap_mb=0)])
def test_hand_written_ddps_sync_buffers_exactly_when_torch_does(wrap):
    r0, r1 = lk.run(buffer_job, 2, args=(wrap,), timeout=30, echo=False).values
    assert tuple(synced(r0, r1)) == SYNCED
