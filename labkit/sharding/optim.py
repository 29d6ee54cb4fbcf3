"""Adam and SGD with momentum written out: the optimizer state ZeRO shards (notebook 06 §1, §4,
§5).

These compute exactly what ``torch.optim.Adam`` and ``torch.optim.SGD(momentum=...)`` compute
with their default (single-tensor, non-fused) arithmetic (``tests/sharding/test_sharding.py``
checks it bit for bit), and they take the same constructor arguments, so a learner's sharded
optimizer can be handed either. :func:`adam_update` and :func:`sgd_update` are one step of one
tensor, elementwise: run on a shard, they update that shard exactly as the whole-tensor step
would (what :class:`labkit.sharding.zero.HandZero` does). Two reasons to have them:

* the state is plain to see: Adam keeps ``exp_avg`` and ``exp_avg_sq`` (2 floats per
  parameter element, 8Ψ bytes in fp32) and a ``step`` counter; SGD keeps ``momentum_buffer``;
* the first ``torch.optim`` step in a fresh process imports ``torch._dynamo`` (seconds on a
  busy 2-core machine); these do not, which keeps the exercise checkers fast.

Example::

    opt = Adam([shard], lr=1e-2)      # shard: a leaf tensor with .grad set
    opt.step()
    opt.state[shard]["exp_avg"]       # the first moment, the shape of the shard
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["Adam", "SGD", "adam_update", "sgd_update"]


@torch.no_grad()
def adam_update(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
    """One Adam step of ``param`` in place (``state`` is created on the first call)."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    beta1, beta2 = betas
    state["step"] += 1
    step = state["step"].item()
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(state["exp_avg"], denom, value=-step_size)


@torch.no_grad()
def sgd_update(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float,
               momentum: float = 0.0) -> None:
    """One SGD step of ``param`` in place, with momentum when ``momentum`` is not 0 (dampening
    0, no Nesterov, like ``torch.optim.SGD``): ``state["momentum_buffer"]`` is created on the
    first call as a copy of ``grad``."""
    if momentum:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = grad.clone()
        else:
            buf.mul_(momentum).add_(grad)
        grad = buf
    param.add_(grad, alpha=-lr)


class _Optimizer:
    def __init__(self, params: Iterable[torch.Tensor], **defaults) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list: pass the "
                             f"tensors to optimize (your shard, say).")
        self.defaults = defaults
        self.state: dict[torch.Tensor, dict] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class Adam(_Optimizer):
    """``torch.optim.Adam(params, lr, betas, eps)`` without weight decay, written out."""

    slots = 2          # state tensors per parameter element: exp_avg, exp_avg_sq

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps)

    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                adam_update(p, p.grad, self.state.setdefault(p, {}), **self.defaults)


class SGD(_Optimizer):
    """``torch.optim.SGD(params, lr, momentum)``, written out (dampening 0, no Nesterov)."""

    slots = 1          # momentum_buffer

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-2,
                 momentum: float = 0.0) -> None:
        super().__init__(params, lr=lr, momentum=momentum)

    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                sgd_update(p, p.grad, self.state.setdefault(p, {}), **self.defaults)
