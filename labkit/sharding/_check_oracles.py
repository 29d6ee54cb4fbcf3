"""One process, the whole batch: what every rank of notebook 06's exercises must reproduce.

The oracles of :mod:`labkit.sharding.check`, computed in the checker's own process from rank
0's initial weights (:mod:`labkit.sharding._check_jobs` builds the same models and data):

* :func:`optimizer_oracle` — the MLP trained with the plain optimizer on the global batch
  (``sum`` mode: the gradients multiplied by the world size, to recognise a summed answer);
* :func:`linear_oracle` — the ZeRO-3 layer: each rank's rows of the output, the gradient of
  its own loss with respect to its input rows, and each rank's shard of the flattened, padded weight-and-bias gradient. Every value
  is exact in fp32, so the comparison is bit for bit;
* :func:`mlp_oracle` — the Megatron MLP: output, input gradient, each rank's slices of every
  weight gradient, and each rank's partial input gradient (what a missing *f* leaves).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._check_jobs import (LR_EXACT, MLP_DIMS, OPT_DIMS, OPT_SETUPS, PER_RANK, DATA, INIT,
                          exact_batch, exact_linear)
from .model import global_batch, make_mlp
from .zero import FlatLayout


def optimizer_oracle(world_size: int, name: str, steps: int, mode: str = "mean"
                     ) -> list[list[torch.Tensor]]:
    """Parameters after each step: ``[step][param]``."""
    inner, defaults = OPT_SETUPS[name]
    model = make_mlp(OPT_DIMS, seed=INIT)
    opt = inner(list(model.parameters()), **defaults)
    history = []
    for step in range(steps):
        x, y = global_batch(PER_RANK * world_size, OPT_DIMS, DATA + step)
        F.mse_loss(model(x), y).backward()
        if mode == "sum":
            for p in model.parameters():
                p.grad *= world_size
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad()
    return history


def linear_oracle(world_size: int, steps: int) -> list[dict]:
    """Per step: ``out``, ``x_grad`` (lists by rank), ``shard_grad`` and ``local`` by rank."""
    layer = exact_linear(INIT)
    layout = FlatLayout([layer.weight.shape, layer.bias.shape], world_size, 0)
    history = []
    for step in range(steps):
        x, t = exact_batch(world_size, step)
        x.requires_grad_()
        out = layer(x)
        ((out * t).sum() / (PER_RANK * world_size)).backward()
        flat = layout.flatten([layer.weight.grad, layer.bias.grad])
        rows = [slice(r * PER_RANK, (r + 1) * PER_RANK) for r in range(world_size)]
        local = []
        for r, rs in enumerate(rows):                 # each rank's own, unreduced gradient
            g = t[rs] / PER_RANK
            lf = layout.flatten([g.t() @ x.detach()[rs], g.sum(0)])
            local.append(layout.shard(lf, r).clone())
        history.append({"out": [out.detach()[rs].clone() for rs in rows],
                        # a rank's input gradient is of its own loss (a mean over its rows)
                        "x_grad": [x.grad[rs] * world_size for rs in rows],
                        "shard_grad": [layout.shard(flat, r).clone() for r in range(world_size)],
                        "local": local})
        with torch.no_grad():
            layer.weight -= LR_EXACT * layer.weight.grad
            layer.bias -= LR_EXACT * layer.bias.grad
        layer.zero_grad()
    return history


def mlp_oracle(world_size: int, steps: int) -> list[dict]:
    """Per step: ``out``, ``x_grad``, ``grads[rank]`` (name -> slice), ``partial_x_grad[rank]``,
    ``bias2`` (the output bias, to recognise one added N times)."""
    model = make_mlp(MLP_DIMS, seed=INIT)
    fc1, fc2 = model[0], model[2]
    k = MLP_DIMS[1] // world_size
    history = []
    for step in range(steps):
        x, y = global_batch(4, MLP_DIMS, DATA + step)
        x.requires_grad_()
        pre = fc1(x)
        pre.retain_grad()
        out = fc2(torch.tanh(pre))
        F.mse_loss(out, y).backward()
        grads, partial = [], []
        for r in range(world_size):
            rows = slice(r * k, (r + 1) * k)
            grads.append({"fc1.weight": fc1.weight.grad[rows], "fc1.bias": fc1.bias.grad[rows],
                          "fc2.weight": fc2.weight.grad[:, rows], "fc2.bias": fc2.bias.grad})
            partial.append(pre.grad[:, rows] @ fc1.weight.detach()[rows])
        history.append({"out": out.detach().clone(), "x_grad": x.grad.clone(),
                        "grads": [{n: g.clone() for n, g in d.items()} for d in grads],
                        "partial_x_grad": partial, "bias2": fc2.bias.detach().clone()})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad()
    return history
