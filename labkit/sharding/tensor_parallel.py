"""Tensor parallelism: Megatron's MLP by hand, then ``parallelize_module`` (notebook 06 §10).

ZeRO shards what a layer *stores*; tensor parallelism shards what a layer *computes*. For an
MLP ``fc2(act(fc1(x)))`` on N ranks (Shoeybi et al., Megatron-LM, 2019):

* :class:`ColumnParallelLinear` — ``fc1``'s weight split by **output** rows: rank r computes
  features ``[r·h/N, (r+1)·h/N)`` of the hidden layer, from the whole input. The activation is
  elementwise, so each rank applies it to its own slice: no communication.
* :class:`RowParallelLinear` — ``fc2``'s weight split by **input** columns: rank r multiplies
  its hidden slice by its columns, which gives a *partial sum* of the output; one
  ``all_reduce`` adds the partial sums. The bias is added once, after it.

Two conjugate operators put the communication in the right place:
``copy_to_parallel`` (Megatron's *f*): identity forward, all-reduce backward (every rank's
slice contributes to the input's gradient); ``reduce_from_parallel`` (*g*): all-reduce
forward, identity backward. So the MLP costs **one all-reduce forward and one backward**
(the backward one only when the input needs a gradient, as inside a network).
``torch.distributed.nn.functional.all_reduce`` is *not* g: its backward all-reduces the
gradient again, which makes every gradient before it N× too large (claim test).

Example (inside a rank)::

    mlp = MegatronMLP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)))
    out = mlp(x)                      # the full output, on every rank
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..grading.references import reference

__all__ = ["copy_to_parallel", "reduce_from_parallel", "ColumnParallelLinear",
           "RowParallelLinear", "MegatronMLP", "label_layers", "TP_DIMS"]

TP_DIMS = (16, 64, 16)


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    @reference
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @reference
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)     # every slice's contribution to dL/dx
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    @reference
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)            # partial sums -> the full output
        return x

    @staticmethod
    @reference
    def backward(ctx, grad):
        return grad, None                          # every rank already has the whole gradient


@reference
def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: the input as is; in backward, the all-reduced gradient."""
    return _CopyToParallel.apply(x, group)


@reference
def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the all-reduced sum of every rank's partial output; identity in backward."""
    return _ReduceFromParallel.apply(x, group)


def _slice(n: int, size: int, rank: int, what: str) -> slice:
    if size % n:
        raise ValueError(f"{what} has {size} features, which {n} ranks cannot split evenly: "
                         f"choose a width divisible by the tensor-parallel size.")
    k = size // n
    return slice(rank * k, (rank + 1) * k)


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of a full ``nn.Linear`` (weight ``[out/N, in]``, bias ``[out/N]``)."""

    def __init__(self, linear: nn.Linear, group=None) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = _slice(n, linear.out_features, rank, "the column-parallel layer's output")
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())

    @reference
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input columns of a full ``nn.Linear`` (weight ``[out, in/N]``); full bias."""

    def __init__(self, linear: nn.Linear, group=None) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        cols = _slice(n, linear.in_features, rank, "the row-parallel layer's input")
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    @reference
    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel(F.linear(x_slice, self.weight), self.group) + self.bias


class MegatronMLP(nn.Module):
    """``Linear -> activation -> Linear`` split over the ranks of ``group``, Megatron style.

    Rank 0's weights are broadcast first, so ranks that built different MLPs agree.
    """

    @reference
    def __init__(self, mlp: nn.Sequential, group=None) -> None:
        super().__init__()
        fc1, act, fc2 = mlp
        with torch.no_grad():
            for p in mlp.parameters():
                dist.broadcast(p, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self.fc1 = ColumnParallelLinear(fc1, group)
        self.act = act
        self.fc2 = RowParallelLinear(fc2, group)

    @reference
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def label_layers(counter, layers: dict[str, nn.Module]) -> list:
    """Tag a :class:`~labkit.sharding.counting.CommCounter`'s calls with ``"<layer> forward"`` /
    ``"<layer> backward"`` using module hooks; returns the hook handles (``.remove()`` them)."""
    handles = []
    for name, module in layers.items():
        def fwd(_module, _args, name=name):
            counter.label = f"{name} forward"

        def bwd(_module, _grad_out, name=name):
            counter.label = f"{name} backward"
        # prepend: run before FSDP2's own hooks, so its gathers carry this layer's label
        handles.append(module.register_forward_pre_hook(fwd, prepend=True))
        handles.append(module.register_full_backward_pre_hook(bwd, prepend=True))
    return handles
