"""Distributed evaluation that equals one process exactly (notebook 08, "Evaluating on every rank").

Each rank evaluates its share of the validation windows, chosen by
``DistributedSampler(shuffle=False)``. When the number of windows ``n`` does
not divide by the world size, the sampler *pads*: it repeats the first few
windows so every rank gets ``ceil(n / world_size)`` of them (every rank must
run the same number of forward passes: under FSDP each one is a collective).
Averaging each rank's mean would count those duplicates twice and weigh the
ranks wrongly. Done right:

1. rank ``r``'s ``k``-th window is window number ``r + k * world_size`` of the
   padded list; numbers ``>= n`` are the padding: they are evaluated (the
   collectives need it) but not counted;
2. each rank sums ``loss x tokens`` and ``tokens`` over its real windows;
3. :func:`all_reduce_sums` adds both over the ranks (the exercise);
4. the mean is ``sum(loss x tokens) / sum(tokens)``.

Why it is *exactly* the one-process number: every forward pass has the same
shape (the last batch is padded to full size), so each window's loss is
the same float32 as in one process; the sums are float64, and adding a few
thousand float32 values of similar size in float64 rounds nothing, so the
order (rank 0's part + rank 1's part, or all in a row) cannot change the
result. ``tests/capstone/test_capstone_eval.py`` asserts ``==`` for 1, 2, 3 and 4 ranks.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["evaluate", "all_reduce_sums", "EvalResult", "rank_windows"]


@dataclass(frozen=True)
class EvalResult:
    loss: float          # mean cross-entropy per token over every validation window, once each
    windows: int         # windows counted (len(data): the padding is not counted)
    tokens: int

    def __str__(self) -> str:
        return f"val loss {self.loss:.6f} | windows {self.windows} | tokens {self.tokens}"


def rank_windows(n: int, rank: int, world_size: int) -> tuple[list[int], list[bool]]:
    """This rank's window indices (padded, as DistributedSampler gives them) and which are real.

    >>> rank_windows(5, 1, 2)      # windows 1, 3 and a padded repeat of window 0
    ([1, 3, 0], [True, True, False])
    """
    indices = list(DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                      shuffle=False))
    real = [rank + k * world_size < n for k in range(len(indices))]
    return indices, real


def all_reduce_sums(loss_sum: float, tokens: int, device: torch.device) -> tuple[float, int]:
    """Add ``loss_sum`` and ``tokens`` over all ranks (float64: exact here). One process: as is."""
    if not (dist.is_available() and dist.is_initialized()):
        return loss_sum, tokens
    both = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return both[0].item(), int(both[1].item())


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, batch_size: int, device: torch.device,
             bf16: bool = False) -> EvalResult:
    """Every rank: mean validation loss over all of ``data``, each window counted once."""
    rank, world = ((dist.get_rank(), dist.get_world_size())
                   if dist.is_available() and dist.is_initialized() else (0, 1))
    indices, real = rank_windows(len(data), rank, world)
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    try:
        for start in range(0, len(indices), batch_size):
            idx, keep = indices[start:start + batch_size], real[start:start + batch_size]
            fill = batch_size - len(idx)         # same shape every pass: same float32 per window
            idx, keep = idx + idx[:1] * fill, keep + [False] * fill
            x = torch.stack([data[i][0] for i in idx]).to(device)
            y = torch.stack([data[i][1] for i in idx]).to(device)
            with amp:
                logits, _ = model(x)
            per_window = F.cross_entropy(logits.float().transpose(1, 2), y,
                                         reduction="none").mean(dim=1)
            mask = torch.tensor(keep, device=device)
            loss_sum += (per_window[mask].double() * y.shape[1]).sum().item()
            tokens += int(mask.sum().item()) * y.shape[1]
    finally:
        model.train(was_training)
    loss_sum, tokens = all_reduce_sums(loss_sum, tokens, device)
    if tokens == 0:
        raise ValueError("no validation windows to evaluate: use more --corpus-bytes or a "
                         "smaller --block-size.")
    return EvalResult(loss_sum / tokens, tokens // data[0][1].shape[0], tokens)
