"""The lesson's model and data: a small MLP and a regression batch (notebook 06, every section).

Every section of notebook 06 trains the same kind of model so that its numbers can be
compared: an ``nn.Sequential`` of ``nn.Linear`` layers with ``tanh`` between them, on a
regression batch that one process can hold whole (the single-process oracle) and that
``rank_batch`` splits evenly over the ranks.

Example (inside a rank)::

    model = make_mlp((32, 64, 64, 16), seed=rank)   # ranks start from different weights
    x, y = rank_batch(rank, world_size, per_rank=8, dims=(32, 64, 64, 16))
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["DIMS", "make_mlp", "global_batch", "rank_batch", "numel", "linears"]

DIMS = (32, 64, 64, 16)      # the notebook's MLP: 32 -> 64 -> 64 -> 16, Ψ = 7,312 parameters


def make_mlp(dims: tuple[int, ...] = DIMS, seed: int | None = 0) -> nn.Sequential:
    """Linear layers of widths ``dims`` with ``tanh`` between them, initialised from ``seed``."""
    if len(dims) < 2:
        raise ValueError(f"dims needs at least an input and an output width, got {dims!r}.")
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def global_batch(n: int, dims: tuple[int, ...] = DIMS, seed: int = 1234
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and regression targets, the same on every rank (seeded, CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dims[0], generator=g)
    y = torch.randn(n, dims[-1], generator=g)
    return x, y


def rank_batch(rank: int, world_size: int, per_rank: int = 8, dims: tuple[int, ...] = DIMS,
               seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous ``per_rank`` rows of the ``world_size * per_rank`` global batch."""
    x, y = global_batch(per_rank * world_size, dims, seed)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows].clone(), y[rows].clone()


def numel(module: nn.Module) -> int:
    """Ψ: the number of parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in module.parameters())


def linears(module: nn.Module) -> list[nn.Linear]:
    """The ``nn.Linear`` layers of a model, in order: the units that get sharded."""
    return [m for m in module.modules() if isinstance(m, nn.Linear)]
