"""One harness for every setup: train, count, measure, compare with one process (notebook 06 §4, §8, bench).

:func:`run_setups` runs in each rank. For every named setup it builds the lesson's MLP from a
**different seed on every rank** (so a setup that forgets to replicate rank 0's weights cannot
pass), trains a few Adam steps on this rank's share of the batch, and records

* ``memory`` — bytes per part (parameters, gradients, optimizer state, DDP buckets, and the
  peak of gathered full parameters for the hand ZeRO stages), measured after the last step;
* ``traffic`` — every collective of the last step (forward, backward, optimizer), counted by
  :class:`labkit.sharding.counting.CommCounter`;
* ``max_diff`` — the largest difference between the setup's full parameters and one process
  training the same model on the whole batch with the same Adam (rank 0's initial weights).

:func:`interleaved_step_times` times setups side by side for the benchmark.

Setups: ``"DDP"``, ``"ZeRO-1"``, ``"ZeRO-2"``, ``"ZeRO-3"`` (by hand, :mod:`.zero`, with
``collectives``; ``"ZeRO-3 ring"`` / ``"ZeRO-3 dist"`` choose per setup),
``"ZeroRedundancyOptimizer"``, ``"FSDP2"`` and ``"FSDP2 no reshard"`` (:mod:`.library`).

Example::

    res = lk.run(lk.sharding.run_setups, 2, args=(["DDP", "ZeRO-3"],))
    res.values[0][1]["memory"]      # rank 0's bytes under ZeRO-3
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .counting import CommCounter
from .model import DIMS, global_batch, make_mlp, numel, rank_batch
from .optim import Adam

__all__ = ["SETUP_NAMES", "build", "oracle_parameters", "run_setups", "interleaved_step_times",
           "INIT_SEED"]

SETUP_NAMES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2",
               "FSDP2 no reshard")
INIT_SEED = 100          # rank r initialises from INIT_SEED + r; the oracle from rank 0's
DATA_SEED = 1234


def build(name: str, model, lr: float, collectives: str = "ring"):
    """(In a rank.) The setup object for ``name`` around ``model``."""
    from .library import TorchDDP, TorchFSDP, TorchZeroRedundancy
    from .zero import HandZero
    stage, _, how = name.partition(" ")             # "ZeRO-3" or "ZeRO-3 ring" / "ZeRO-3 dist"
    if stage in ("ZeRO-1", "ZeRO-2", "ZeRO-3") and how in ("", "ring", "dist"):
        return HandZero(model, int(stage[-1]), lr, how or collectives)
    makers = {"DDP": lambda: TorchDDP(model, lr), "ZeroRedundancyOptimizer":
              lambda: TorchZeroRedundancy(model, lr), "FSDP2": lambda: TorchFSDP(model, lr, True),
              "FSDP2 no reshard": lambda: TorchFSDP(model, lr, False)}
    if name not in makers:
        raise ValueError(f"unknown setup {name!r}: choose from {SETUP_NAMES}.")
    return makers[name]()


def oracle_parameters(world_size: int, dims=DIMS, steps: int = 3, lr: float = 1e-2,
                      per_rank: int = 8) -> list[torch.Tensor]:
    """One process, the whole batch of every step, Adam: the parameters every setup must reach."""
    model = make_mlp(dims, seed=INIT_SEED)
    opt = Adam(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = global_batch(per_rank * world_size, dims, DATA_SEED + step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train_one(rank: int, world_size: int, name: str, dims, steps: int, lr: float,
               per_rank: int, collectives: str, oracle) -> dict:
    model = make_mlp(dims, seed=INIT_SEED + rank)
    psi = numel(model)
    setup = build(name, model, lr, collectives)
    comm, memory = CommCounter(), {}
    for step in range(steps):
        x, y = rank_batch(rank, world_size, per_rank, dims, DATA_SEED + step)
        last = step == steps - 1
        if last:
            comm.__enter__()
        try:
            F.mse_loss(setup.module(x), y).backward()
            setup.step()
        finally:
            if last:
                comm.__exit__(None, None, None)
        if last:
            memory = setup.memory()
        setup.zero_grad()
    full = setup.full_parameters()
    diff = max(float((a - b).abs().max()) for a, b in zip(full, oracle))
    memory["total"] = sum(v for k, v in memory.items() if k != "transient" and v)
    return {"setup": name, "impl": setup.name, "world_size": world_size, "rank": rank, "psi": psi,
            "memory": memory, "traffic": comm.totals(), "kinds": comm.kinds(),
            "volume": comm.volume(), "ring_sent": comm.ring_sent(), "max_diff": diff}


def run_setups(rank: int, world_size: int, names=("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"),
               dims=DIMS, steps: int = 3, lr: float = 1e-2, per_rank: int = 8,
               collectives: str = "ring") -> list[dict]:
    """(In a rank.) Train, count and measure each setup in ``names``; one dict per setup."""
    oracle = oracle_parameters(world_size, dims, steps, lr, per_rank)
    return [_train_one(rank, world_size, name, dims, steps, lr, per_rank, collectives, oracle)
            for name in names]


def interleaved_step_times(rank: int, world_size: int, names, dims=DIMS, rounds: int = 10,
                           per_rank: int = 8, lr: float = 1e-2) -> dict[str, list[float]]:
    """(In a rank.) Step times in ms of every setup, timed in turn: round k times each setup
    once, in an order rotated by k, after a barrier. Setups measured side by side under the
    same load compare fairly on a shared machine (one setup after the other would not)."""
    x, y = rank_batch(rank, world_size, per_rank, dims, DATA_SEED)
    setups = [build(name, make_mlp(dims, seed=INIT_SEED + rank), lr, "dist") for name in names]

    def step(setup) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        F.mse_loss(setup.module(x), y).backward()
        setup.step()
        setup.zero_grad()
        return (time.perf_counter() - t0) * 1e3
    for setup in setups:                       # warm-up: buckets, lazy init, optimizer state
        step(setup)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for i in range(len(setups)):
            j = (i + k) % len(setups)
            times[names[j]].append(step(setups[j]))
    return times
