"""The rank side of notebook 06's exercise checkers: run the learner's code, record everything.

Each job runs in every rank of an ``lk.run``, and nothing in it can be known in advance:

* every rank draws its **initial weights and its data from a secret of its own**
  (``os.urandom``, per grading) and reports them; the checker builds the one-process oracle
  from the reports afterwards (:mod:`labkit.sharding.check.oracles`), so an answer that copies
  the oracle or skips the communication has nothing to copy. Ranks start from different
  weights, so an answer that forgets to broadcast rank 0's fails;
* the answer arrives pickled and is loaded **after** a :class:`~labkit.grading.integrity.Census`
  baseline, so what it holds is counted over the whole rank process (closures, defaults,
  globals, tensor attributes, kept graphs), not over its attributes, and a library object
  (``ZeroRedundancyOptimizer``, ``DTensor`` ...) is found wherever it is kept;
* all communication is counted by :class:`~.counting.CommCounter` (this thread, threads it
  starts, future callbacks), with copies of what each op sent (``keep_tensors``): what the
  Megatron all-reduces and the ZeRO-3 ring's sends carried is judged, not only their size.

The comparisons and the messages are in :mod:`labkit.sharding.check`.
"""
from __future__ import annotations

import os

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...grading.integrity import LIBRARY, Census, CensusError
from ...grading.references import references_used
from ..counting import CommCounter
from ..model import make_mlp
from ..optim import SGD, Adam

OPT_DIMS = (6, 34, 5)          # Ψ = 413, 379 trainable: no world size divides it (padding)
FROZEN = 1                     # parameter 1 (fc1's bias) is frozen: requires_grad=False
OPT_SETUPS = {"SGD with momentum": (SGD, {"lr": 0.1, "momentum": 0.9}),
              # eps 1e-2: Adam scales every element's step to about lr whatever its gradient,
              # so an element whose gradient nearly cancels (a tiny mean of larger terms) turns
              # fp32's summation-order noise into a step error; a larger eps bounds that error
              # (at most lr/(4·eps) per unit of gradient noise) below the checker's tolerance.
              # With eps 1e-8, one right answer in a few hundred gradings differed by 1.1e-6.
              "Adam": (Adam, {"lr": 0.05, "eps": 1e-2})}
LINEAR = (6, 5)                # Ψ = 35 (weight 30 + bias 5): padded on 2 and 4 ranks
MLP_DIMS = (6, 8, 5)           # hidden 8: split into 8/N columns / rows
MLP_BATCH = 4
PER_RANK = 4                   # a power of two: the ZeRO-3 layer's arithmetic is exact
LR_EXACT = 0.125


def secret() -> torch.Generator:
    """A generator seeded from ``os.urandom``: this rank's, this grading's, nobody else's."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))


def _kinds(comm: CommCounter, label: str) -> list[str]:
    return [c["kind"] for c in comm.calls if c["label"] == label]


def _bytes(comm: CommCounter, label: str, kind: str) -> int:
    return sum(c["bytes"] for c in comm.calls if c["label"] == label and c["kind"] == kind)


def _sent(comm: CommCounter, label: str, kind: str) -> list[torch.Tensor]:
    """The first tensor each ``kind`` op under ``label`` carried, copied as it was issued."""
    return [c["sent"][0] for c in comm.calls
            if c["label"] == label and c["kind"] == kind and c.get("sent")]


def _census(census: Census, exclude: list) -> dict:
    """What the rank holds besides ``exclude`` (elements), and the library/optimizer objects."""
    try:
        return {"held": census.held(exclude).elements(), "library": census.instances(LIBRARY),
                "optimizers": census.optimizers()}
    except CensusError as exc:
        return {"error": str(exc)}


# ------------------------------------------------------------- exercise 1: ZeRO-1 optimizer
# What each exercise's answer may not call: the lab's own implementation of it. ZeRO-3's layer
# is built from the ring halves of §3 (lk.sharding.ring_*), which stay allowed.
LAB = {"optimizer_job": ("labkit.sharding.zero.HandZero.",),
       "linear_job": ("labkit.sharding.zero.HandZero.",),
       "mlp_job": ("labkit.sharding.tensor_parallel.",)}


def watched(rank: int, world_size: int, job: str, blob: bytes, steps: int) -> dict:
    """Run the checker's ``job`` in a rank, noting any of the lab's own implementations of the
    exercise that ran meanwhile: ``{"value": ..., "references": [...]}``."""
    with references_used(*LAB[job]) as used:
        value = globals()[job](rank, world_size, blob, steps)
    return {"value": value, "references": used}


def optimizer_job(rank: int, world_size: int, blob: bytes, steps: int) -> dict:
    with Census() as census:
        answer = cloudpickle.loads(blob)
        out: dict[str, dict] = {}
        for name, (inner, defaults) in OPT_SETUPS.items():
            out[name] = _optimizer_run(census, answer, inner, defaults, steps, out)
        return out


def _optimizer_run(census: Census, answer, inner, defaults: dict, steps: int, done) -> dict:
    """One optimizer's run; ``done`` (the earlier runs' reports) is the checker's too."""
    g = secret()
    model = make_mlp(OPT_DIMS, seed=int(torch.randint(2**62, (1,), generator=g)))
    params = list(model.parameters())
    params[FROZEN].requires_grad_(False)
    init = [p.detach().clone() for p in params]
    data = [(torch.randn(PER_RANK, OPT_DIMS[0], generator=g),
             torch.randn(PER_RANK, OPT_DIMS[-1], generator=g)) for _ in range(steps)]
    comm = CommCounter()
    comm.label = "init"
    with comm:
        opt = answer(params, inner, **defaults)
    history, held = [], []
    for step, (x, y) in enumerate(data):
        F.mse_loss(model(x), y).backward()
        comm.label = f"step {step}"
        with comm:
            opt.step()
        history.append([p.detach().clone() for p in params])
        for p in params:
            p.grad = None
        held.append(_census(census, [model, init, data, history, comm.records, held, done]))
    steps_comm = [{kind: _bytes(comm, f"step {s}", kind) for kind in
                   ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "send")}
                  for s in range(steps)]
    del opt
    return {"init": init, "data": data, "params": history, "census": held, "comm": steps_comm}


# ------------------------------------------------------------- exercise 2: ZeRO-3 layer
def exact_linear(g: torch.Generator) -> nn.Linear:
    """An ``nn.Linear(6, 5)`` with weights in quarters: fp32 arithmetic on it is exact."""
    layer = nn.Linear(*LINEAR)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-4, 5, layer.weight.shape, generator=g) / 4)
        layer.bias.copy_(torch.randint(-4, 5, layer.bias.shape, generator=g) / 4)
    return layer


def exact_rows(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a step's batch: small integers, so every sum is exact in fp32."""
    return (torch.randint(-3, 4, (PER_RANK, LINEAR[0]), generator=g).float(),
            torch.randint(-2, 3, (PER_RANK, LINEAR[1]), generator=g).float())


def linear_job(rank: int, world_size: int, blob: bytes, steps: int) -> dict:
    with Census() as census:
        answer = cloudpickle.loads(blob)
        g = secret()
        layer = exact_linear(g)
        init = [layer.weight.detach().clone(), layer.bias.detach().clone()]
        data = [exact_rows(g) for _ in range(steps)]
        comm = CommCounter(keep_tensors=True)
        comm.label = "init"
        with comm:
            module = answer(layer)
        del layer                           # from here on, only the answer may keep it
        shard = getattr(module, "shard", None)
        if not isinstance(shard, torch.Tensor):
            return {"error": f"the wrapper has no tensor attribute `shard` (got "
                             f"{type(shard).__name__}): keep this rank's slice in self.shard"}
        records = []
        for step, (x_rows, t_rows) in enumerate(data):
            x = x_rows.clone().requires_grad_()
            comm.label = f"step {step}"
            with comm:
                out = module(x)
                ((out * t_rows).sum() / PER_RANK).backward()
            grad = None if shard.grad is None else shard.grad.detach().clone()
            records.append({"out": out.detach().clone(), "x_grad": None if x.grad is None else
                            x.grad.clone(), "shard_grad": grad,
                            "shard": shard.detach().clone(),
                            "kinds": _kinds(comm, f"step {step}"),
                            "sent": _bytes(comm, f"step {step}", "send"),
                            "sends": _sent(comm, f"step {step}", "send")})
            with torch.no_grad():
                if shard.grad is not None:
                    shard -= LR_EXACT * shard.grad
                shard.grad = None
            del x, out
            records[-1]["census"] = _census(census, [init, data, records, comm.records, shard])
        return {"init": init, "data": data, "records": records,
                "shard_shape": tuple(shard.shape),
                "shard_storage": shard.untyped_storage().nbytes() // max(shard.element_size(), 1),
                "params": [tuple(p.shape) for p in module.parameters()]}


# ------------------------------------------------------------- exercise 3: Megatron MLP
def mlp_job(rank: int, world_size: int, blob: bytes, steps: int) -> dict:
    with Census() as census:
        answer = cloudpickle.loads(blob)
        g = secret()
        mlp = make_mlp(MLP_DIMS, seed=int(torch.randint(2**62, (1,), generator=g)))
        init = [p.detach().clone() for p in mlp.parameters()]
        data = [(torch.randn(MLP_BATCH, MLP_DIMS[0], generator=g),
                 torch.randn(MLP_BATCH, MLP_DIMS[-1], generator=g)) for _ in range(steps)]
        for x, y in data:                   # the same batch on every rank: rank 0's
            dist.broadcast(x, 0)
            dist.broadcast(y, 0)
        comm = CommCounter(keep_tensors=True)
        comm.label = "init"
        with comm:
            module = answer(mlp)
        del mlp                             # from here on, only the answer may keep it
        named = dict(module.named_parameters())
        records = []
        for step, (x_data, y) in enumerate(data):
            x = x_data.clone().requires_grad_()
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
                            "backward": _kinds(comm, f"backward {step}"),
                            "payloads": {phase: _sent(comm, f"{phase} {step}", "all_reduce")
                                         for phase in ("forward", "backward")}})
            with torch.no_grad():
                for p in named.values():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                    p.grad = None
            del x, out, loss
            records[-1]["census"] = _census(census, [init, data, records, comm.records])
        return {"init": init, "data": data, "records": records,
                "shapes": {n: tuple(_plain(p).shape) for n, p in named.items()}}


def _plain(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return (inner if isinstance(inner, torch.Tensor) else t).detach()


COPY = ("Weights and data are drawn afresh in every grading from each rank's own secret: a "
        "precomputed or copied result (the checker's oracle) cannot match.")


def census_problem(census: dict, r: int, where: str) -> str | None:
    """A census the rank could not take (the answer tampered with the collector), or a library
    object found anywhere in the rank process."""
    if "error" in census:
        return f"rank {r}, {where}: {census['error']}."
    if census["library"]:
        return (f"rank {r}, {where}: the rank process holds {', '.join(census['library'])} "
                f"(found among its live objects, wherever it is kept: an attribute, a closure, "
                f"a global): this exercise asks you to do it by hand, not with torch's library.")
    return None
