"""The rank side of notebook 06's exercise checkers: run the learner's code, record everything.

Each job runs in every rank of an ``lk.run``. Every rank builds its model from a **different
seed**, so an answer that forgets to broadcast rank 0's weights fails; all communication is
counted by :class:`~labkit.sharding.counting.CommCounter` (the answer cannot hide a
collective); what the answer's objects hold is read from their storages with
:func:`~labkit.sharding.memory.reachable_tensors` (whatever the attributes are called). The
comparisons and the messages are in :mod:`labkit.sharding.check`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .counting import CommCounter
from .memory import reachable_tensors, storage_key
from .model import make_mlp, rank_batch
from .optim import SGD, Adam

OPT_DIMS = (6, 33, 5)          # Ψ = 401: no world size divides it (padding needed)
OPT_SETUPS = {"SGD with momentum": (SGD, {"lr": 0.1, "momentum": 0.9}),
              "Adam": (Adam, {"lr": 0.05})}
LINEAR = (6, 5)                # Ψ = 35 (weight 30 + bias 5): padded on 2 and 4 ranks
MLP_DIMS = (6, 8, 5)           # hidden 8: split into 8/N columns / rows
INIT, DATA = 300, 4321
PER_RANK = 4                   # a power of two: the ZeRO-3 layer's arithmetic is exact


def _kinds(comm: CommCounter, label: str) -> list[str]:
    return [c["kind"] for c in comm.calls if c["label"] == label]


def _sent(comm: CommCounter, label: str) -> int:
    return sum(c["bytes"] for c in comm.calls if c["label"] == label and c["kind"] == "send")


def held_elements(obj, exclude) -> int:
    """Elements of every distinct storage ``obj`` holds, leaving out ``exclude``'s storages and
    every gradient (a tensor's ``.grad`` is gradient memory, not state)."""
    skip = {storage_key(t) for t in exclude if t is not None}
    tensors = reachable_tensors(obj)
    grads = {storage_key(t.grad) for t in tensors if t.grad is not None}
    sizes = {}
    for t in tensors:
        key = storage_key(t)
        if key not in skip and key not in grads and key[1] != 0:
            s = t.untyped_storage()
            sizes[key] = s.nbytes() // max(t.element_size(), 1)
    return sum(sizes.values())


def _library_objects(obj) -> list[str]:
    """Names of torch's own sharding classes found inside the answer's objects."""
    names = ("ZeroRedundancyOptimizer", "DistributedDataParallel", "DTensor", "FSDPModule")
    found, seen = set(), set()

    def walk(o, depth):
        if depth < 0 or id(o) in seen:
            return
        seen.add(id(o))
        for cls in type(o).__mro__:
            if any(cls.__name__.startswith(n) for n in names):
                found.add(cls.__name__)
        if isinstance(o, dict):
            for v in o.values():
                walk(v, depth - 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth - 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            for v in vars(o).values():
                walk(v, depth - 1)
    walk(obj, 5)
    return sorted(found)


# ------------------------------------------------------------- exercise 1: ZeRO-1 optimizer
def optimizer_job(rank: int, world_size: int, answer, steps: int) -> dict:
    out = {}
    for name, (inner, defaults) in OPT_SETUPS.items():
        model = make_mlp(OPT_DIMS, seed=INIT + rank)
        params = list(model.parameters())
        comm = CommCounter()
        comm.label = "init"
        with comm:
            opt = answer(params, inner, **defaults)
        history, state = [], []
        for step in range(steps):
            x, y = rank_batch(rank, world_size, PER_RANK, OPT_DIMS, DATA + step)
            F.mse_loss(model(x), y).backward()
            comm.label = f"step {step}"
            with comm:
                opt.step()
            history.append([p.detach().clone() for p in params])
            state.append(held_elements(opt, params))
            for p in params:
                p.grad = None
        out[name] = {"params": history, "state": state, "library": _library_objects(opt),
                     "kinds": sorted({c["kind"] for c in comm.calls if c["label"] != "init"})}
    return out


# ------------------------------------------------------------- exercise 2: ZeRO-3 layer
def exact_linear(seed: int) -> nn.Linear:
    """An ``nn.Linear(6, 5)`` with weights in quarters: fp32 arithmetic on it is exact."""
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(*LINEAR)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-4, 5, layer.weight.shape, generator=g) / 4)
        layer.bias.copy_(torch.randint(-4, 5, layer.bias.shape, generator=g) / 4)
    return layer


def exact_batch(world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: small integers, so every sum is exact in fp32."""
    g = torch.Generator().manual_seed(DATA + 10 * world_size + step)
    n = PER_RANK * world_size
    return (torch.randint(-3, 4, (n, LINEAR[0]), generator=g).float(),
            torch.randint(-2, 3, (n, LINEAR[1]), generator=g).float())


LR_EXACT = 0.125


def linear_job(rank: int, world_size: int, answer, steps: int) -> dict:
    comm = CommCounter()
    comm.label = "init"
    with comm:
        module = answer(exact_linear(INIT + rank))
    shard = getattr(module, "shard", None)
    if not isinstance(shard, torch.Tensor):
        return {"error": f"the wrapper has no tensor attribute `shard` (got "
                         f"{type(shard).__name__}): keep this rank's slice in self.shard"}
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    records = []
    for step in range(steps):
        x_all, t_all = exact_batch(world_size, step)
        x = x_all[rows].clone().requires_grad_()
        comm.label = f"step {step}"
        with comm:
            out = module(x)
            ((out * t_all[rows]).sum() / PER_RANK).backward()
        grad = None if shard.grad is None else shard.grad.detach().clone()
        records.append({"out": out.detach().clone(), "x_grad": None if x.grad is None else
                        x.grad.clone(), "shard_grad": grad,
                        "shard": shard.detach().clone(),
                        "held": held_elements(module, [shard]),
                        "kinds": _kinds(comm, f"step {step}"),
                        "sent": _sent(comm, f"step {step}")})
        with torch.no_grad():
            if shard.grad is not None:
                shard -= LR_EXACT * shard.grad
            shard.grad = None
    return {"records": records, "shard_shape": tuple(shard.shape),
            "shard_storage": shard.untyped_storage().nbytes() // max(shard.element_size(), 1),
            "params": [tuple(p.shape) for p in module.parameters()],
            "library": _library_objects(module)}


# ------------------------------------------------------------- exercise 3: Megatron MLP
def mlp_job(rank: int, world_size: int, answer, steps: int) -> dict:
    comm = CommCounter()
    comm.label = "init"
    with comm:
        module = answer(make_mlp(MLP_DIMS, seed=INIT + rank))
    named = {n: p for n, p in module.named_parameters()}
    records = []
    for step in range(steps):
        x, y = rank_batch(0, 1, 4, MLP_DIMS, DATA + step)        # the same batch on every rank
        x.requires_grad_()
        comm.label = f"forward {step}"
        with comm:
            out = module(x)
            loss = F.mse_loss(out, y)
            comm.label = f"backward {step}"
            loss.backward()
        records.append({"out": out.detach().clone(), "x_grad": None if x.grad is None else
                        x.grad.clone(),
                        "grads": {n: None if p.grad is None else _plain(p.grad).clone()
                                  for n, p in named.items()},
                        "forward": _kinds(comm, f"forward {step}"),
                        "backward": _kinds(comm, f"backward {step}")})
        with torch.no_grad():
            for p in named.values():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                p.grad = None
    return {"records": records, "shapes": {n: tuple(_plain(p).shape) for n, p in named.items()},
            "library": _library_objects(module)}


def _plain(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return (inner if isinstance(inner, torch.Tensor) else t).detach()
