"""Answers to notebook 06's exercises for the checker tests: right ones, and the classic wrong ones.

The right answers are the notebook's solutions (solutions/06_sharding.ipynb); each wrong one is
a mistake a learner makes, and tests/sharding/test_sharding_check.py asserts which named case it fails.
Registered with cloudpickle by value, so the ranks need not import this file.
"""
from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ----------------------------------------------------------------- exercise 1: ZeRO-1
class ShardedOptimizer:
    """The right answer: broadcast, flatten + pad, own 1/N, reduce-scatter, step, all-gather."""

    average = True

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, src=0)
        self.numel = sum(p.numel() for p in self.params)
        self.k = -(-self.numel // self.world_size)
        flat = self._flat([p.detach() for p in self.params])
        self.slice = nn.Parameter(flat[self.rank * self.k:(self.rank + 1) * self.k].clone())
        self.optimizer = optimizer_class([self.slice], **defaults)

    def _flat(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.k * self.world_size - self.numel))

    @torch.no_grad()
    def step(self):
        mine = torch.empty(self.k)
        dist.reduce_scatter_tensor(mine, self._flat([p.grad for p in self.params]))
        self.slice.grad = mine / self.world_size if self.average else mine
        self.optimizer.step()
        full = torch.empty(self.k * self.world_size)
        dist.all_gather_into_tensor(full, self.slice.detach().clone())
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class SummedOptimizer(ShardedOptimizer):
    """Wrong: the reduce-scattered gradient is used as a sum."""

    average = False


class PlainOptimizer:
    """Wrong: each rank runs the optimizer on its own full parameters, no communication."""

    def __init__(self, params, optimizer_class, **defaults):
        self.optimizer = optimizer_class(list(params), **defaults)

    def step(self):
        self.optimizer.step()


class DoNothingOptimizer:
    """Lazy: a step that does nothing at all."""

    def __init__(self, params, optimizer_class, **defaults):
        pass

    def step(self):
        pass


class UnshardedOptimizer:
    """Wrong: right numbers (broadcast, all-reduce, average), but every rank keeps all the state."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, src=0)
        self.optimizer = optimizer_class(self.params, **defaults)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optimizer.step()


class NoBroadcastOptimizer(ShardedOptimizer):
    """Wrong: shards right, but never replicates rank 0's initial weights."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.k = -(-self.numel // self.world_size)
        flat = self._flat([p.detach() for p in self.params])
        self.slice = nn.Parameter(flat[self.rank * self.k:(self.rank + 1) * self.k].clone())
        self.optimizer = optimizer_class([self.slice], **defaults)


# ----------------------------------------------------------------- exercise 2: ZeRO-3 layer
def _ring_halves():
    from labkit.sharding import ring_all_gather, ring_reduce_scatter
    return ring_all_gather, ring_reduce_scatter


class _Gather3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, layer):
        weight, bias = layer.gather(shard)
        ctx.save_for_backward(x, shard)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        layer = ctx.layer
        weight, _ = layer.cached if layer.keep else layer.gather(shard)
        grad_x = grad_out @ weight
        flat = layer.flatten(grad_out.t() @ x, grad_out.sum(0))
        grad_shard = layer.reduce_scatter(flat)
        if layer.average:
            grad_shard = grad_shard / dist.get_world_size()
        return grad_x, grad_shard, None


class ShardedLinear(nn.Module):
    """The right answer: broadcast, keep 1/N of the flat [weight, bias]; gather, compute, free."""

    keep, average, broadcast, library = False, True, True, False

    def __init__(self, linear):
        super().__init__()
        rank, n = dist.get_rank(), dist.get_world_size()
        if self.broadcast:
            with torch.no_grad():
                dist.broadcast(linear.weight, src=0)
                dist.broadcast(linear.bias, src=0)
        self.out_f, self.in_f = linear.weight.shape
        self.numel = linear.weight.numel() + linear.bias.numel()
        self.k = -(-self.numel // n)
        flat = self.flatten(linear.weight.detach(), linear.bias.detach())
        self.shard = nn.Parameter(flat[rank * self.k:(rank + 1) * self.k].clone())

    def flatten(self, weight, bias):
        flat = torch.cat([weight.reshape(-1), bias.reshape(-1)])
        return F.pad(flat, (0, self.k * dist.get_world_size() - self.numel))

    def gather(self, shard):
        if self.library:
            full = torch.empty(self.k * dist.get_world_size())
            dist.all_gather_into_tensor(full, shard.detach().clone())
        else:
            full = _ring_halves()[0](shard.detach().clone())
        w = full[:self.out_f * self.in_f].view(self.out_f, self.in_f)
        b = full[self.out_f * self.in_f:self.numel]
        if self.keep:
            self.cached = (w, b)                  # the mistake: the full weight stays around
        return w, b

    def reduce_scatter(self, flat):
        if self.library:
            out = torch.empty(self.k)
            dist.reduce_scatter_tensor(out, flat)
            return out
        return _ring_halves()[1](flat)

    def forward(self, x):
        return _Gather3.apply(x, self.shard, self)


class SummedLinear(ShardedLinear):
    average = False


class KeepsFullLinear(ShardedLinear):
    """Wrong: keeps the gathered weight after forward and reuses it in backward (no free)."""

    keep = True


class LibraryLinear(ShardedLinear):
    """Wrong here: right numbers with dist.all_gather_into_tensor / reduce_scatter_tensor."""

    library = True


class NoBroadcastLinear(ShardedLinear):
    broadcast = False


class UnshardedLinear(nn.Module):
    """Wrong: every rank keeps the whole layer and all-reduces its gradients (DDP, not ZeRO-3)."""

    def __init__(self, linear):
        super().__init__()
        with torch.no_grad():
            dist.broadcast(linear.weight, src=0)
            dist.broadcast(linear.bias, src=0)
        self.linear = linear
        self.shard = linear.weight

    def forward(self, x):
        return self.linear(x)


# ----------------------------------------------------------------- exercise 3: Megatron MLP
class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ParallelMLP(nn.Module):
    """The right answer: broadcast, fc1 by output rows, fc2 by input columns, f and g."""

    use_f, library_g, bias_each_rank = True, False, False

    def __init__(self, mlp):
        super().__init__()
        fc1, act, fc2 = mlp
        rank, n = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for p in mlp.parameters():
                dist.broadcast(p, src=0)
        k = fc1.out_features // n
        rows = slice(rank * k, (rank + 1) * k)
        self.fc1 = nn.Linear(fc1.in_features, k)
        self.fc2 = nn.Linear(k, fc2.out_features)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1.weight[rows])
            self.fc1.bias.copy_(fc1.bias[rows])
            self.fc2.weight.copy_(fc2.weight[:, rows])
            self.fc2.bias.copy_(fc2.bias)
        self.act = act

    def forward(self, x):
        if self.use_f:
            x = CopyToParallel.apply(x)
        h = self.act(self.fc1(x))
        partial = F.linear(h, self.fc2.weight)
        if self.bias_each_rank:
            partial = partial + self.fc2.bias
        if self.library_g:
            import torch.distributed.nn.functional as dnf
            out = dnf.all_reduce(partial)
        else:
            out = ReduceFromParallel.apply(partial)
        return out if self.bias_each_rank else out + self.fc2.bias


class LibraryAllReduceMLP(ParallelMLP):
    """Wrong: torch.distributed.nn.functional.all_reduce as g (its backward all-reduces again)."""

    library_g = True


class NoFMLP(ParallelMLP):
    """Wrong: forgets f, so the input's gradient is never all-reduced."""

    use_f = False


class BiasEachRankMLP(ParallelMLP):
    """Wrong: every rank adds fc2's bias before the all-reduce (N times in the sum)."""

    bias_each_rank = True


class ReplicatedMLP(nn.Module):
    """Wrong: every rank keeps the whole MLP (no tensor parallelism at all)."""

    def __init__(self, mlp):
        super().__init__()
        with torch.no_grad():
            for p in mlp.parameters():
                dist.broadcast(p, src=0)
        self.fc1, self.act, self.fc2 = mlp

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class LibraryTPMLP(nn.Module):
    """Wrong here: torch's parallelize_module does it (DTensor parameters)."""

    def __init__(self, mlp):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.fc1, self.act, self.fc2 = mlp
        parallelize_module(self, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
