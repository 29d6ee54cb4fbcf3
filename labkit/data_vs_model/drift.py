"""The naive idea first: replicas that train on their own data drift apart (notebook 01 §1).

:func:`replica_drift` — 4 ranks train their own copy of a small model on their own data.
Without communication the copies drift apart (4 different models); with gradients averaged by
``all_reduce`` (data parallelism) they stay identical: checksum spread exactly 0.

Example::

    apart = lk.data_vs_model.replica_drift(data_parallel=False)["spread"][-1]   # > 0
    same = lk.data_vs_model.replica_drift(data_parallel=True)["spread"][-1]     # 0.0
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..common.ranks import checksum, device
from ..runtime import run

__all__ = ["replica_drift"]


def _drift_rank(rank: int, world_size: int, steps: int, data_parallel: bool, lr: float,
                seed: int) -> dict:
    dev = device()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev)
    torch.manual_seed(seed)                     # the same start on every rank ...
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(seed + 1000 + rank)   # ... but each rank its own data
    w_true = torch.linspace(-1, 1, 8)
    checksums, distances, losses = [], [], []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.3 * torch.randn(16, 1, generator=g)
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        model.zero_grad()
        loss.backward()
        if data_parallel:                       # notebook 02 builds this into DDP
            for p in model.parameters():
                dist.all_reduce(p.grad)         # sum over ranks ...
                p.grad /= world_size            # ... / N = the average gradient
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=lr)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)         # measuring only: compare every pair of replicas
        distances.append(max(float((a - b).norm()) for a in everyone for b in everyone))
        checksums.append(checksum(model))
        losses.append(float(loss))
    return {"checksums": checksums, "distance": distances, "losses": losses}


def replica_drift(world_size: int = 4, steps: int = 30, data_parallel: bool = False,
                  lr: float = 0.05, seed: int = 0) -> dict:
    """Train one small model per rank, each on its own data, with or without gradient averaging.

    Returns ``{"checksums": [rank][step], "distance": [step], "spread": [step],
    "losses": [rank][step], "data_parallel": bool}``: ``distance`` is the largest
    L2 distance between two replicas' parameters, ``spread`` the largest
    difference of two ranks' checksums (exactly 0.0 when they are identical).

    Example::

        apart = replica_drift(data_parallel=False)["spread"][-1]   # > 0
        same = replica_drift(data_parallel=True)["spread"][-1]     # 0.0
    """
    res = run(_drift_rank, world_size, args=(steps, data_parallel, lr, seed), echo=False)
    sums = [v["checksums"] for v in res.values]
    spread = [max(col) - min(col) for col in zip(*sums)]
    return {"checksums": sums, "distance": res.values[0]["distance"], "spread": spread,
            "losses": [v["losses"] for v in res.values], "data_parallel": data_parallel}
