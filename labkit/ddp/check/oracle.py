"""The DDP exercises' model, data and single-process oracle (notebook 02: step 5, the challenge).

* :class:`TiedTiny` has the traps: a **frozen** layer (``.grad`` stays ``None``), **tied**
  weights (embedding = output layer, one parameter used twice) and a **buffer** that changes
  the output, so a replica that kept its own buffer computes other gradients;
* :func:`shard_batches` / :func:`rank_batches` give each rank its own shard per step, the
  last one **uneven** (3, 2, 3, 2 ... examples);
* :func:`oracle_history` is one process that holds every shard and computes
  ``mean over ranks of (mean loss on that rank's shard)`` — exactly what
  ``torch.nn.parallel.DistributedDataParallel`` computes (tests/ddp/test_ddp.py checks this) —
  from a given start (``init``) on given shards, or from a seed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TiedTiny", "shard_batches", "rank_batches", "oracle_history", "state_of",
           "STEPS", "LR", "SEED", "BATCH", "VOCAB"]

STEPS, LR, SEED, BATCH, VOCAB = 3, 0.5, 1234, 4, 11
Batch = tuple[torch.Tensor, torch.Tensor]


class TiedTiny(nn.Module):
    """A tiny next-token model with the traps: tied weights, a frozen layer and a buffer."""

    def __init__(self, vocab: int = VOCAB, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight          # tied: one parameter, used twice
        self.register_buffer("shift", torch.randn(dim) * 0.5)   # replicated like a parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(dim=1) + self.shift
        h = torch.tanh(self.hidden(torch.tanh(self.frozen(h))))
        return self.head(h)


def _sizes(world_size: int, step: int, steps: int, batch: int) -> list[int]:
    return [batch] * world_size if step < steps - 1 else \
        [batch - 1 - (r % 2) for r in range(world_size)]


def rank_batches(rank: int, world_size: int, generator: torch.Generator, steps: int = STEPS,
                 batch: int = BATCH) -> list[Batch]:
    """One rank's ``(tokens, targets)`` for every step, drawn from ``generator``."""
    return [(torch.randint(0, VOCAB, (n, 3), generator=generator),
             torch.randint(0, VOCAB, (n,), generator=generator))
            for n in (_sizes(world_size, s, steps, batch)[rank] for s in range(steps))]


def shard_batches(world_size: int, steps: int = STEPS, batch: int = BATCH,
                  seed: int = SEED) -> list[list[Batch]]:
    """``[step][rank] -> (tokens, targets)`` from one seed; the last step is uneven."""
    g = torch.Generator().manual_seed(seed + world_size)
    out = []
    for step in range(steps):
        out.append([(torch.randint(0, VOCAB, (n, 3), generator=g),
                     torch.randint(0, VOCAB, (n,), generator=g))
                    for n in _sizes(world_size, step, steps, batch)])
    return out


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, detached CPU copies (tied weights once)."""
    out = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    out.update({n: b.detach().cpu().clone() for n, b in model.named_buffers()})
    return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def sgd_step(model: nn.Module, lr: float) -> None:
    """Plain SGD by hand (torch.optim's first use in a fresh process imports torch._dynamo:
    seconds on 2 busy cores, which would dominate the grader's runtime)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(p.grad, alpha=lr)


def oracle_history(world_size: int, steps: int = STEPS, lr: float = LR, seed: int = SEED, *,
                   init: dict | None = None, shards: list[list[Batch]] | None = None
                   ) -> list[dict]:
    """One process, whole batch: per step the averaged gradients, each rank's local ones, the state.

    Starts from ``init`` (a :func:`state_of` dict; default: ``TiedTiny()`` seeded with
    ``seed``) and trains on ``shards`` (``[step][rank]``; default: :func:`shard_batches`).
    Each step: ``{"grads", "local" (one dict per rank), "params" (parameters and buffers)}``.
    """
    torch.manual_seed(seed)
    model = TiedTiny()
    if init is not None:
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                t.copy_(init[name])
    history = []
    for batches in shard_batches(world_size, steps, seed=seed) if shards is None else shards:
        local = []
        for x, y in batches:                       # each rank's own gradient, for diagnosis
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            local.append(_grads(model))
        model.zero_grad()
        loss = sum(F.cross_entropy(model(x), y) for x, y in batches) / world_size
        loss.backward()
        grads = _grads(model)
        sgd_step(model, lr)
        history.append({"grads": grads, "local": local, "params": state_of(model)})
    return history
