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
2. :func:`all_reduce_sums` (notebook 08 §5: the learner writes it) gets this rank's
   per-window losses and which of them are real, and returns the sum of the
   real windows' losses and their number, both added over all ranks;
3. the mean is ``sum / count`` (every window has ``block_size`` tokens, so
   this is also the mean per token).

Why it is *exactly* the one-process number: every forward pass has the same
shape (the last batch is padded to full size), so each window's loss is
the same float32 as in one process; the sums are float64, and adding a few
thousand float32 values of similar size in float64 rounds nothing, so the
order (rank 0's part + rank 1's part, or all in a row) cannot change the
result. ``tests/capstone/test_capstone_eval.py`` asserts ``==`` for 1, 2, 3 and 4 ranks.
The training script passes its own ``all_reduce_sums`` to :func:`evaluate`
(``reduce=``): that is the name ``train_gpt.py --pieces`` replaces.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

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


def all_reduce_sums(window_losses: torch.Tensor, real: torch.Tensor,
                    device: torch.device) -> tuple[float, int]:
    """Sum of the real windows' losses and their number, over all ranks (float64: exact).

    Args:
        window_losses: this rank's evaluated windows' mean losses (float32, padding included).
        real: bool, same length: False for the padding duplicates DistributedSampler added.
        device: where the collective runs (the process group's device).

    One process (no process group): this rank's own sum and count.
    """
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()]).to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return both[0].item(), int(both[1].item())


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, batch_size: int, device: torch.device,
             bf16: bool = False, reduce: Callable = all_reduce_sums) -> EvalResult:
    """Every rank: mean validation loss over all of ``data``, each window counted once.

    ``reduce(window_losses, real, device) -> (sum, count)`` adds the ranks' parts
    (default :func:`all_reduce_sums`).
    """
    rank, world = ((dist.get_rank(), dist.get_world_size())
                   if dist.is_available() and dist.is_initialized() else (0, 1))
    indices, real = rank_windows(len(data), rank, world)
    was_training = model.training
    model.eval()
    losses = []
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    try:
        for start in range(0, len(indices), batch_size):
            idx = indices[start:start + batch_size]
            fill = batch_size - len(idx)         # same shape every pass: same float32 per window
            x = torch.stack([data[i][0] for i in idx + idx[:1] * fill]).to(device)
            y = torch.stack([data[i][1] for i in idx + idx[:1] * fill]).to(device)
            with amp:
                logits, _ = model(x)
            per_window = F.cross_entropy(logits.float().transpose(1, 2), y,
                                         reduction="none").mean(dim=1)
            losses.append(per_window[:len(idx)].cpu())
    finally:
        model.train(was_training)
    window_losses = torch.cat(losses) if losses else torch.zeros(0)
    loss_sum, windows = reduce(window_losses, torch.tensor(real, dtype=torch.bool), device)
    if windows == 0:
        raise ValueError("no validation windows to evaluate: use more --corpus-bytes or a "
                         "smaller --block-size.")
    block = data[0][1].shape[0]
    return EvalResult(loss_sum / windows, windows, windows * block)
