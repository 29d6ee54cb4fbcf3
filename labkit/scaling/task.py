"""The training task every measurement of notebook 07 shares: a teacher network to imitate.

A fixed random "teacher" MLP labels Gaussian inputs; a student MLP (the lab's
:func:`labkit.common.models.mlp` body with a linear head) learns to reproduce it with MSE. Data
and weights come from seeds only, so two runs that should be comparable (uncompressed vs
compressed gradients, fp32 vs bf16, 1 vs 4 ranks) see exactly the same samples in the same
order, and a rank's shard of step ``s`` is a pure function of ``(seed, s, rank, world_size)``.

Example (inside a rank)::

    model = student(width=128, depth=3)
    x, y = batch(step=0, size=64, rank=rank, world_size=world_size)
    loss = F.mse_loss(model(x), y)
"""
from __future__ import annotations

import torch
from torch import nn

from ..common.models import mlp

__all__ = ["IN_DIM", "OUT_DIM", "student", "batch", "label", "eval_set", "eval_loss",
           "param_count"]

IN_DIM, OUT_DIM = 32, 8
_teachers: dict[int, nn.Module] = {}


def student(width: int = 128, depth: int = 3, seed: int = 0) -> nn.Sequential:
    """The model being trained: in 32 → ``depth`` tanh blocks of ``width`` → out 8."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_DIM, width), nn.Tanh(), *mlp(width, depth - 1, seed + 1),
                         nn.Linear(width, OUT_DIM))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _teacher(seed: int) -> nn.Module:
    if seed not in _teachers:
        g = torch.Generator().manual_seed(10_000 + seed)
        w1 = torch.randn(IN_DIM, 64, generator=g) / IN_DIM ** 0.5
        w2 = torch.randn(64, OUT_DIM, generator=g) / 8.0
        _teachers[seed] = lambda x: torch.tanh(x @ w1) @ w2 * 2.0
    return _teachers[seed]


def label(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The teacher's targets for inputs ``x`` (shape ``(n, IN_DIM)``)."""
    return _teacher(seed)(x)


def batch(step: int, size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard (``size`` samples) of global step ``step``.

    The global batch of a step is ``size * world_size`` samples drawn from the step's seed;
    rank r gets rows ``r*size .. (r+1)*size``. So 4 ranks x 32 see exactly the samples that
    1 rank x 128 sees at the same step.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size * world_size, IN_DIM, generator=g)[rank * size:(rank + 1) * size]
    return x.to(device), _teacher(seed)(x).to(device)


def eval_set(size: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out samples (never trained on) to compare final losses."""
    g = torch.Generator().manual_seed(7_777_777 + seed)
    x = torch.randn(size, IN_DIM, generator=g)
    return x, _teacher(seed)(x)


@torch.no_grad()
def eval_loss(model: nn.Module, seed: int = 0) -> float:
    """MSE of ``model`` on :func:`eval_set` (float32, no communication)."""
    x, y = eval_set(seed=seed)
    p = next(model.parameters())
    return float(nn.functional.mse_loss(model(x.to(p.device)).float(), y.to(p.device)))
