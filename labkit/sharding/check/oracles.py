"""One process, the whole batch: what every rank of notebook 06's exercises must reproduce.

The oracles of :mod:`labkit.sharding.check`, computed in the checker's own process **after**
the ranks ran, from what they reported: rank 0's initial weights and every rank's data, each
drawn from a secret of that rank's (:mod:`labkit.sharding.check.jobs`). Nothing here can be
computed before a grading, so an answer that imports this module has nothing to copy.

* :func:`optimizer_oracle` — the MLP (one parameter frozen) trained with the plain optimizer on
  the global batch (``sum`` mode: the gradients multiplied by the world size, to recognise a
  summed answer);
* :func:`linear_oracle` — the ZeRO-3 layer: each rank's rows of the output, the gradient of
  its own loss with respect to its input rows, and each rank's shard of the flattened, padded
  weight-and-bias gradient. Every value is exact in fp32, so the comparison is bit for bit;
* :func:`mlp_oracle` — the Megatron MLP: output, input gradient, each rank's slices of every
  weight gradient, and what each rank's all-reduces must carry: its partial output (forward)
  and its partial input gradient (backward, also what a missing *f* leaves).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .jobs import FROZEN, LINEAR, LR_EXACT, MLP_DIMS, OPT_DIMS, OPT_SETUPS, PER_RANK
from ..model import make_mlp
from ..zero import FlatLayout


def _model(dims, init: list[torch.Tensor]) -> torch.nn.Sequential:
    model = make_mlp(dims, seed=None)
    with torch.no_grad():
        for p, w in zip(model.parameters(), init):
            p.copy_(w)
    return model


def _batch(data_by_rank: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: every rank's rows, in rank order."""
    return (torch.cat([d[step][0] for d in data_by_rank]),
            torch.cat([d[step][1] for d in data_by_rank]))


def optimizer_oracle(name: str, init: list[torch.Tensor], data_by_rank: list, steps: int,
                     mode: str = "mean") -> list[list[torch.Tensor]]:
    """Parameters after each step, ``[step][param]``, from rank 0's ``init`` and every rank's
    ``data``; the frozen parameter stays as it was."""
    inner, defaults = OPT_SETUPS[name]
    model = _model(OPT_DIMS, init)
    params = list(model.parameters())
    params[FROZEN].requires_grad_(False)
    opt = inner([p for p in params if p.requires_grad], **defaults)
    history = []
    for step in range(steps):
        x, y = _batch(data_by_rank, step)
        F.mse_loss(model(x), y).backward()
        if mode == "sum":
            for p in params:
                if p.grad is not None:
                    p.grad *= len(data_by_rank)
        opt.step()
        history.append([p.detach().clone() for p in params])
        opt.zero_grad()
    return history


def linear_oracle(init: list[torch.Tensor], data_by_rank: list, steps: int) -> list[dict]:
    """Per step: ``out``, ``x_grad`` (lists by rank), ``shard_grad`` and ``local`` by rank."""
    world_size = len(data_by_rank)
    layer = torch.nn.Linear(*LINEAR)
    with torch.no_grad():
        layer.weight.copy_(init[0])
        layer.bias.copy_(init[1])
    layout = FlatLayout([layer.weight.shape, layer.bias.shape], world_size, 0)
    history = []
    for step in range(steps):
        x, t = _batch(data_by_rank, step)
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


def mlp_oracle(world_size: int, init: list[torch.Tensor], data: list, steps: int) -> list[dict]:
    """Per step: ``out``, ``x_grad``, ``grads[rank]`` (name -> slice), ``partial_out[rank]``
    and ``partial_x_grad[rank]`` (what rank's forward and backward all-reduce must carry),
    ``bias2`` (the output bias, to recognise one added N times)."""
    model = _model(MLP_DIMS, init)
    fc1, fc2 = model[0], model[2]
    k = MLP_DIMS[1] // world_size
    history = []
    for step in range(steps):
        x, y = (t.clone() for t in data[step])
        x.requires_grad_()
        pre = fc1(x)
        pre.retain_grad()
        hidden = torch.tanh(pre)
        out = fc2(hidden)
        F.mse_loss(out, y).backward()
        grads, partial, partial_out = [], [], []
        for r in range(world_size):
            rows = slice(r * k, (r + 1) * k)
            grads.append({"fc1.weight": fc1.weight.grad[rows], "fc1.bias": fc1.bias.grad[rows],
                          "fc2.weight": fc2.weight.grad[:, rows], "fc2.bias": fc2.bias.grad})
            partial.append(pre.grad[:, rows] @ fc1.weight.detach()[rows])
            partial_out.append(hidden.detach()[:, rows] @ fc2.weight.detach()[:, rows].t())
        history.append({"out": out.detach().clone(), "x_grad": x.grad.clone(),
                        "grads": [{n: g.clone() for n, g in d.items()} for d in grads],
                        "partial_x_grad": partial, "partial_out": partial_out,
                        "bias2": fc2.bias.detach().clone()})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad()
    return history
