"""The small models the lessons train on real ranks (deterministic from a seed)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["mlp"]


def mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear+Tanh blocks of ``width`` units (deterministic from ``seed``)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
