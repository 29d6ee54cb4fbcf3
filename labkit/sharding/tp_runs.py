"""Tensor parallelism on real ranks, checked against one process (notebook 06 §10, §12).

Three jobs, each run in every rank by ``lk.run``:

* :func:`tp_by_hand` — the hand-written :class:`~labkit.sharding.tensor_parallel.MegatronMLP`
  against the same MLP in one process: output, input gradient and every weight gradient
  (against the matching slice of the oracle's), with the all-reduces counted per layer.
* :func:`tp_library` — the same with ``parallelize_module(mlp, mesh, {"0": ColwiseParallel(),
  "2": RowwiseParallel()})`` on a CPU mesh.
* :func:`mesh_2d` — 4 ranks as a 2 × 2 mesh: tensor parallel inside each pair (``"tp"``), FSDP2
  across the pairs (``"dp"``); a few Adam steps compared with one process training on the
  whole batch, and what each rank holds (and which of fc1's rows) and sends, per layer.

Every rank builds its MLP from a different seed; the hand version broadcasts rank 0's weights,
``parallelize_module`` distributes rank 0's (``distribute_tensor``'s ``src_data_rank=0``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ddp.naive import broadcast_parameters
from .counting import CommCounter
from .harness import INIT_SEED
from .memory import local, storage_bytes
from .model import global_batch, make_mlp
from .optim import Adam
from .tensor_parallel import TP_DIMS, MegatronMLP, label_layers

__all__ = ["tp_by_hand", "tp_library", "mesh_2d"]


def _max_diff(pairs) -> float:
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def _sends(comm: CommCounter) -> dict[str, dict]:
    return {label: {"calls": t["calls"], "bytes": t["bytes"], "ring_sent": t["ring_sent"]}
            for label, t in comm.totals(by="label").items()}


def _holds(layers: dict) -> dict[str, dict]:
    return {name: {"shapes": [tuple(local(p).shape) for p in m.parameters()],
                   "bytes": storage_bytes(m.parameters())} for name, m in layers.items()}


def _against_one_process(mlp, layers: dict, dims, batch: int) -> dict:
    """One forward and backward of ``mlp`` (collectives counted per layer) and of one process."""
    oracle = make_mlp(dims, seed=INIT_SEED)
    x, y = global_batch(batch, dims)
    x.requires_grad_()
    xo = x.detach().clone().requires_grad_()
    comm = CommCounter()
    handles = label_layers(comm, layers)
    with comm:
        out = mlp(x)
        F.mse_loss(out, y).backward()
    for h in handles:
        h.remove()
    ref = oracle(xo)
    F.mse_loss(ref, y).backward()
    return {"oracle": oracle, "out_diff": _max_diff([(out, ref)]),
            "x_grad_diff": _max_diff([(x.grad, xo.grad)]), "sends": _sends(comm),
            "holds": _holds(layers)}


def tp_by_hand(rank: int, world_size: int, dims=TP_DIMS, batch: int = 8) -> dict:
    """(In a rank.) Hand-written Megatron MLP vs one process; all-reduces counted per layer."""
    mlp = MegatronMLP(make_mlp(dims, seed=INIT_SEED + rank))
    res = _against_one_process(mlp, {"fc1": mlp.fc1, "fc2": mlp.fc2}, dims, batch)
    oracle = res.pop("oracle")
    k = dims[1] // world_size
    rows = slice(rank * k, (rank + 1) * k)
    grads = [(mlp.fc1.weight.grad, oracle[0].weight.grad[rows]),
             (mlp.fc1.bias.grad, oracle[0].bias.grad[rows]),
             (mlp.fc2.weight.grad, oracle[2].weight.grad[:, rows]),
             (mlp.fc2.bias.grad, oracle[2].bias.grad)]
    return {**res, "grad_diff": _max_diff(grads),
            "full_bytes": {"fc1": storage_bytes(oracle[0].parameters()),
                           "fc2": storage_bytes(oracle[2].parameters())}}


def tp_library(rank: int, world_size: int, dims=TP_DIMS, batch: int = 8) -> dict:
    """(In a rank.) ``parallelize_module`` with Colwise/RowwiseParallel vs one process."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from .library import cpu_mesh
    mlp = make_mlp(dims, seed=INIT_SEED + rank)
    parallelize_module(mlp, cpu_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    res = _against_one_process(mlp, {"fc1": mlp[0], "fc2": mlp[2]}, dims, batch)
    oracle = res.pop("oracle")
    grads = [(p.grad.full_tensor(), q.grad) for p, q in zip(mlp.parameters(), oracle.parameters())]
    return {**res, "grad_diff": _max_diff(grads),
            "placements": {n: str(p.placements) for n, p in mlp.named_parameters()}}


def mesh_2d(rank: int, world_size: int, dims=(16, 64, 16), steps: int = 3, per_dp: int = 8,
            lr: float = 1e-2) -> dict:
    """(In a rank of 4.) 2 data-parallel × 2 tensor-parallel: FSDP2 over ``dp``, TP over ``tp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from .library import cpu_mesh
    if world_size != 4:
        raise ValueError(f"mesh_2d is a 2 x 2 mesh: run it on 4 ranks, not {world_size}.")
    mesh = cpu_mesh((2, 2), ("dp", "tp"))
    mlp = make_mlp(dims, seed=INIT_SEED + rank)
    broadcast_parameters(mlp)          # FSDP2 shards what each rank has: replicate rank 0's
    parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (mlp[0], mlp[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(mlp, mesh=mesh["dp"])
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    oracle = make_mlp(dims, seed=INIT_SEED)
    oracle_opt = Adam(oracle.parameters(), lr=lr)
    dp = mesh["dp"].get_local_rank()
    comm, losses = CommCounter(), []
    handles = label_layers(comm, {"fc1": mlp[0], "fc2": mlp[2]})
    for step in range(steps):
        x, y = global_batch(2 * per_dp, dims, seed=1234 + step)
        rows = slice(dp * per_dp, (dp + 1) * per_dp)
        comm.clear()
        with comm:
            loss = F.mse_loss(mlp(x[rows]), y[rows])
            loss.backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        oracle_opt.step()
        oracle_opt.zero_grad()
        losses.append(loss.item())
    for h in handles:
        h.remove()
    full = [p.detach().full_tensor() for p in mlp.parameters()]
    mine = local(mlp[0].weight).detach()
    fc1_rows = [i for i in range(len(full[0])) if any(torch.equal(full[0][i], r) for r in mine)]
    return {"coords": {"dp": dp, "tp": mesh["tp"].get_local_rank()}, "losses": losses,
            "fc1_rows": fc1_rows,
            "max_diff": _max_diff(zip(full, oracle.parameters())),
            "holds": _holds({"fc1": mlp[0], "fc2": mlp[2]}),
            "placements": {n: str(p.placements) for n, p in mlp.named_parameters()},
            "sends": _by_layer_and_group(comm, mesh)}


def _by_layer_and_group(comm: CommCounter, mesh) -> list[dict]:
    """One row per (layer and phase, collective, mesh dimension) of the last step."""
    dims = {tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group()))): name
            for name in ("dp", "tp")}
    rows: dict[tuple, dict] = {}
    for c in comm.calls:
        key = (c["label"], c["kind"], dims.get(tuple(sorted(c["group_ranks"])), "world"))
        row = rows.setdefault(key, {"layer": c["label"], "kind": c["kind"], "mesh_dim": key[2],
                                    "calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += c["bytes"]
    return list(rows.values())
