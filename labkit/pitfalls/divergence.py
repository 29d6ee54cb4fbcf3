"""Gradient mismatch and divergence: training bugs that make replicas drift apart (notebook 04).

Data parallelism is correct only while every replica takes the same step. Each
scenario here breaks that in a way real code does, on real gloo ranks, and
returns an :class:`~labkit.pitfalls.Outcome` whose verdict is asserted in
tests/pitfalls/test_pitfalls.py:

=====================  ==================================================  =================
runner                 what goes wrong                                      verdict kind
=====================  ==================================================  =================
unsynced_training      no gradient all-reduce: every rank trains alone       replicas_diverged
unused_parameters      a parameter outside the loss: DDP raises, iteration 2 unused_parameters
sampler_shards         no DistributedSampler, or no ``set_epoch``            data_sharding
batchnorm_stats        BatchNorm running stats computed per rank             replicas_diverged
accumulation           all-reduce every micro-batch (slow), or never (wrong) ok / diverged
uneven_inputs          ranks with different numbers of batches: a timeout    missing_rank
=====================  ==================================================  =================

Each takes ``fixed=True`` (or a mode) for the version that works. The fix for
BatchNorm on CPU is :class:`AllReduceBatchNorm1d` (``SyncBatchNorm`` needs GPUs):
it all-reduces the batch statistics by hand.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..common.ranks import device
from ..diagnosis import ShardLog, fingerprint
from .scenario import Outcome, scenario, scenario_fn

__all__ = ["tiny_model", "global_batch", "shard_batch", "unsynced_training", "unused_parameters",
           "sampler_shards", "AllReduceBatchNorm1d", "batchnorm_stats", "accumulation",
           "uneven_inputs", "oracle_fingerprint", "broken_training",
           "bn_model", "GLOBAL_BATCH", "sgd_step"]

GLOBAL_BATCH = 12   # divisible by 1, 2, 3, 4 ranks
# One process-group timeout for every training scenario, so consecutive jobs reuse warm ranks
# (a new timeout means new ranks). The deadline is generous because DDP's first construction in
# a fresh rank imports torch._dynamo (seconds on 2 busy cores); failures still come at the timeout.
DDP_LIMITS = {"timeout": 3.0, "deadline": 30.0}


def tiny_model() -> nn.Module:
    """The same small regression model on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def global_batch(step: int, n: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of training step ``step`` (the same on every rank and in the oracle)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def shard_batch(rank: int, world_size: int, step: int):
    """This rank's equal share of the global batch of ``step``, on this rank's device."""
    x, y = global_batch(step)
    per = len(x) // world_size
    sl = slice(rank * per, (rank + 1) * per)
    return x[sl].to(device()), y[sl].to(device())


def sgd_step(model: nn.Module, lr: float) -> None:
    """``p -= lr * p.grad`` for every parameter: plain SGD, by hand.

    (``torch.optim.SGD`` does the same; building one in a fresh process first
    imports ``torch._dynamo``, seconds on 2 cores, so the light scenarios skip it.)
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def oracle_fingerprint(steps: int = 3, lr: float = 0.1):
    """One process, the whole batch each step: what every replica must end up equal to."""

    model = tiny_model()
    for step in range(steps):
        x, y = global_batch(step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        sgd_step(model, lr)
    return fingerprint(model)


# ------------------------------------------------------------ no gradient sync
@scenario_fn
def broken_training(rank, world_size, steps=3, lr=0.1):
    """Each rank trains on its shard... and never talks to the others."""

    model = tiny_model().to(device())
    for step in range(steps):
        x, y = shard_batch(rank, world_size, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        # BUG: no gradient synchronisation here
        sgd_step(model, lr)
    return fingerprint(model)


@scenario_fn
def _ddp_training_step(rank, world_size, steps=3, lr=0.1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_model().to(device()))   # FIX: DDP averages gradients during backward
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = shard_batch(rank, world_size, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return fingerprint(model)


def unsynced_training(world_size: int = 2, fixed: bool = False, steps: int = 3) -> Outcome:
    """Training without gradient sync: replicas diverge. ``fixed``: the same loop under DDP."""
    fn = _ddp_training_step if fixed else broken_training
    return scenario("unsynced_training", fn, world_size, **DDP_LIMITS, steps=steps)


# ------------------------------------------------------------ DDP and unused parameters
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.aux = nn.Linear(6, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))  # BUG: self.aux never takes part in the loss


@scenario_fn
def _unused_parameters_step(rank, world_size, steps=3, fixed=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_TwoHeads().to(device()), find_unused_parameters=fixed)  # FIX: True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):         # the error comes at the start of iteration 2
        x, y = shard_batch(rank, world_size, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return fingerprint(model)


def unused_parameters(world_size: int = 2, fixed: bool = False) -> Outcome:
    """DDP with a parameter that gets no gradient; ``fixed``: ``find_unused_parameters=True``."""
    return scenario("unused_parameters", _unused_parameters_step, world_size, **DDP_LIMITS,
                    fixed=fixed)


# ------------------------------------------------------------ data sharding
@scenario_fn
def _sampler_shards_step(rank, world_size, mode="fixed", epochs=2, size=16):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    ds = TensorDataset(torch.arange(size))
    if mode == "no_sampler":          # BUG: every rank loads the whole dataset
        loader = DataLoader(ds, batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        sampler = None
    else:
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=4, sampler=sampler)
    seen = []
    for epoch in range(epochs):
        if sampler is not None and mode == "fixed":
            sampler.set_epoch(epoch)  # FIX: a new shuffle every epoch (BUG: forgetting this)
        seen.append(tuple(int(i) for (batch,) in loader for i in batch))
    return ShardLog(rank, tuple(seen), size)


def sampler_shards(world_size: int = 2, mode: str = "fixed", epochs: int = 2) -> Outcome:
    """The indices each rank sees: ``mode`` is ``no_sampler``, ``no_set_epoch`` or ``fixed``."""
    if mode not in ("no_sampler", "no_set_epoch", "fixed"):
        raise ValueError(f"mode must be 'no_sampler', 'no_set_epoch' or 'fixed', not {mode!r}")
    return scenario("sampler_shards", _sampler_shards_step, world_size, **DDP_LIMITS, mode=mode,
                    epochs=epochs)


# ------------------------------------------------------------ BatchNorm
class AllReduceBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose batch statistics are all-reduced across ranks (SyncBatchNorm, by hand).

    In training, every rank normalises with the mean and variance of the
    *global* batch, and updates its running statistics with them, so replicas
    keep identical buffers. The all-reduce is ``torch.distributed.nn.functional
    .all_reduce``, which is differentiable: backward sums the statistics'
    gradients across ranks, as SyncBatchNorm does. Works on gloo and NCCL.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([float(len(x))])])
        stats = all_reduce(stats)                           # one collective per forward
        c = self.num_features
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean              # biased: used to normalise
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(m * mean.detach())
            self.running_var.mul_(1 - m).add_(m * var.detach() * n / (n - 1))  # unbiased
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y * self.weight + self.bias if self.affine else y


def bn_model(sync: bool) -> nn.Module:
    torch.manual_seed(0)
    norm = AllReduceBatchNorm1d(8) if sync else nn.BatchNorm1d(8)
    return nn.Sequential(nn.Linear(6, 8), norm, nn.Tanh(), nn.Linear(8, 1))


@scenario_fn
def _batchnorm_stats_step(rank, world_size, steps=3, sync=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(bn_model(sync).to(device()))   # BUG: plain BatchNorm1d (FIX: sync=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = shard_batch(rank, world_size, step)
        x = x * (1 + rank)                      # shards differ in scale, as real shards do
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return fingerprint(model)


def batchnorm_stats(world_size: int = 2, sync: bool = False, steps: int = 3) -> Outcome:
    """BatchNorm under DDP: running stats differ per rank; ``sync``: all-reduce the batch stats."""
    return scenario("batchnorm_stats", _batchnorm_stats_step, world_size, **DDP_LIMITS,
                    steps=steps, sync=sync)


# ------------------------------------------------------------ gradient accumulation
@scenario_fn
def _accumulation_step(rank, world_size, mode="no_sync", micro=3, steps=2):
    import contextlib
    import time
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_model().to(device()))
    calls = [0]

    def counting_hook(state, bucket):  # every gradient all-reduce DDP launches passes here
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = shard_batch(rank, world_size, step)
        opt.zero_grad()
        for k, (xs, ys) in enumerate(zip(x.tensor_split(micro), y.tensor_split(micro))):
            last = k == micro - 1
            skip = mode == "no_sync_always" or (mode == "no_sync" and not last)
            # sync_every: all-reduce after every micro-batch (correct, micro x the traffic)
            # no_sync: skip the all-reduce except on the last micro-batch (FIX)
            # no_sync_always: never all-reduce (BUG: replicas drift)
            with model.no_sync() if skip else contextlib.nullcontext():
                (nn.functional.mse_loss(model(xs), ys) / micro).backward()
        opt.step()
    return {"allreduces": calls[0], "seconds": time.perf_counter() - t0,
            "fingerprint": fingerprint(model)}


def accumulation(world_size: int = 2, mode: str = "no_sync", micro: int = 3,
                 steps: int = 2) -> Outcome:
    """Gradient accumulation: ``sync_every``, ``no_sync`` (the fix) or ``no_sync_always`` (bug)."""
    if mode not in ("sync_every", "no_sync", "no_sync_always"):
        raise ValueError(f"mode must be 'sync_every', 'no_sync' or 'no_sync_always', not {mode!r}")
    return scenario("accumulation", _accumulation_step, world_size, **DDP_LIMITS, mode=mode,
                    micro=micro, steps=steps)


# ------------------------------------------------------------ uneven inputs
@scenario_fn
def _uneven_inputs_step(rank, world_size, join=False):
    import contextlib
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_model().to(device()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 2 + rank                # BUG: rank r has 2 + r batches (uneven shards)
    with Join([model]) if join else contextlib.nullcontext():  # FIX: Join shadows finished ranks
        for step in range(batches):
            x, y = shard_batch(rank, world_size, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return batches


def uneven_inputs(world_size: int = 2, join: bool = False) -> Outcome:
    """Rank r trains 2 + r batches: the last waits in backward until the timeout; Join fixes it."""
    return scenario("uneven_inputs", _uneven_inputs_step, world_size, **DDP_LIMITS, join=join)
