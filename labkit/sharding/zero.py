"""ZeRO by hand: stages 1, 2 and 3 built from reduce-scatter and all-gather (notebook 06 §4).

Each ``nn.Linear`` is one *unit*: its weight and bias are laid end to end in one flat buffer,
padded to a multiple of N and cut into N equal shards (:class:`FlatLayout`: FSDP1's and
DeepSpeed's "flat parameter"; FSDP2 shards each parameter along dim 0 instead). Rank r owns
shard r. Then, per unit:

* **ZeRO-1** (optimizer state sharded) — backward fills the full ``.grad`` as usual; the step
  reduce-scatters the flattened gradient (rank r gets the sum of its shard), divides by N,
  runs Adam on its shard only (state: 1/N), and all-gathers the updated shards back into the
  full parameters. Sends: Ψ + Ψ = 2Ψ, as DDP.
* **ZeRO-2** (+ gradients sharded) — the reduce-scatter happens *during* backward, as soon as a
  unit's gradient is complete (a ``post_accumulate_grad`` hook), and the full gradient is freed
  at once: only the 1/N gradient shard stays. Sends: 2Ψ.
* **ZeRO-3** (+ parameters sharded) — a rank keeps only its parameter shard. The forward of a
  unit all-gathers the full weight, computes, and frees it; its backward all-gathers it again,
  computes the gradients, frees the weight and reduce-scatters the weight gradient. Sends: 3Ψ.

Collectives are the ring's two halves (:mod:`labkit.sharding.ring`, ``collectives="ring"``) or
torch's ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (``"dist"``). The class follows
the lesson's setup protocol (:mod:`labkit.sharding.harness`): ``module``, ``step()``,
``zero_grad()``, ``memory()``, ``full_parameters()``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ddp.naive import broadcast_parameters
from .memory import storage_bytes
from .optim import adam_update
from .ring import ring_all_gather, ring_reduce_scatter

__all__ = ["FlatLayout", "reduce_scatter", "all_gather", "Meter", "Zero3Linear", "HandZero"]


class FlatLayout:
    """Where a unit's tensors lie in one flat buffer of ``world_size * shard_numel`` elements.

    >>> lay = FlatLayout([torch.Size([5, 3]), torch.Size([5])], world_size=4, rank=1)
    >>> lay.numel, lay.shard_numel, lay.padded
    (20, 5, 20)
    """

    def __init__(self, shapes, world_size: int, rank: int) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)
        self.world_size, self.rank = world_size, rank
        self.shard_numel = -(-self.numel // world_size)          # ceil: the last shard is padded
        self.padded = self.shard_numel * world_size

    def flatten(self, tensors) -> torch.Tensor:
        """A new padded flat tensor holding ``tensors`` end to end (zeros in the padding)."""
        ref = tensors[0]
        flat = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the unit's tensors."""
        out, offset = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[offset:offset + size].view(shape))
            offset += size
        return out

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s shard of ``flat`` (a view)."""
        r = self.rank if rank is None else rank
        return flat[r * self.shard_numel:(r + 1) * self.shard_numel]


def reduce_scatter(flat: torch.Tensor, collectives: str = "ring") -> torch.Tensor:
    """This rank's shard of the sum of ``flat`` over all ranks (a new tensor)."""
    if collectives == "ring":
        return ring_reduce_scatter(flat)
    out = flat.new_empty(flat.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(out, flat)
    return out


def all_gather(shard: torch.Tensor, out: torch.Tensor | None = None,
               collectives: str = "ring") -> torch.Tensor:
    """Every rank's ``shard`` end to end, in ``out`` when given (a new tensor otherwise)."""
    if collectives == "ring":
        return ring_all_gather(shard, out)
    if out is None:
        out = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, shard.clone())
    return out


class Meter:
    """Bytes of full (gathered) parameters and gradients alive right now, and the peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        return t

    def free(self, t: torch.Tensor) -> None:
        self.live -= t.numel() * t.element_size()


class _GatherLinear(torch.autograd.Function):
    """ZeRO-3's linear layer: gather, compute, free — in forward, and again in backward."""

    @staticmethod
    def forward(ctx, x, shard, unit):
        full = unit.meter.hold(all_gather(shard, collectives=unit.collectives))
        weight, bias = unit.layout.views(full)
        out = F.linear(x, weight, bias)
        unit.meter.free(full)                      # nothing keeps `full`: it is freed here
        ctx.save_for_backward(x, shard)            # the shard, not the gathered weight
        ctx.unit = unit
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        unit = ctx.unit
        full = unit.meter.hold(all_gather(shard, collectives=unit.collectives))
        weight, _ = unit.layout.views(full)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        flat_grad = unit.meter.hold(unit.layout.flatten([g.t() @ x.reshape(-1, x.shape[-1]),
                                                         g.sum(0)]))
        unit.meter.free(full)
        grad_shard = reduce_scatter(flat_grad, unit.collectives).div_(dist.get_world_size())
        unit.meter.free(flat_grad)
        return grad_x, grad_shard, None


class Zero3Linear(nn.Module):
    """An ``nn.Linear`` of which this rank keeps only its 1/N shard (``self.shard``)."""

    def __init__(self, linear: nn.Linear, collectives: str = "ring", meter: Meter | None = None):
        super().__init__()
        if linear.bias is None:
            raise ValueError("Zero3Linear shards weight and bias together: give it an "
                             "nn.Linear with bias=True.")
        n, rank = dist.get_world_size(), dist.get_rank()
        self.layout = FlatLayout([linear.weight.shape, linear.bias.shape], n, rank)
        flat = self.layout.flatten([linear.weight.detach(), linear.bias.detach()])
        self.shard = nn.Parameter(self.layout.shard(flat).clone())   # the full flat goes away
        self.collectives, self.meter = collectives, meter or Meter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherLinear.apply(x, self.shard, self)

    def full_weight_bias(self) -> list[torch.Tensor]:
        """(Collective: every rank calls it.) The current full weight and bias."""
        return [v.clone() for v in self.layout.views(all_gather(self.shard.detach(),
                                                                collectives=self.collectives))]


class _Unit:
    """Stages 1 and 2: one layer whose parameters are views into a full flat buffer."""

    def __init__(self, module: nn.Module, n: int, rank: int) -> None:
        self.params = list(module.parameters(recurse=False))
        self.layout = FlatLayout([p.shape for p in self.params], n, rank)
        self.flat = self.layout.flatten([p.detach() for p in self.params])
        for p, view in zip(self.params, self.layout.views(self.flat)):
            p.data = view                          # the parameters now live in self.flat
        self.grad_shard: torch.Tensor | None = None
        self.ready = 0
        self.state: dict = {}


class HandZero:
    """ZeRO stage 1, 2 or 3 by hand over a model's ``nn.Linear`` layers, with Adam.

    Args:
        model: the model (each rank's own; rank 0's parameters are broadcast first).
        stage: 1, 2 or 3.
        lr: Adam's learning rate (betas 0.9/0.999, eps 1e-8, like ``torch.optim.Adam``).
        collectives: ``"ring"`` (the ring's two halves, isend/irecv) or ``"dist"``.
    """

    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-2,
                 collectives: str = "ring") -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}.")
        if collectives not in ("ring", "dist"):
            raise ValueError(f"collectives must be 'ring' or 'dist', got {collectives!r}.")
        self.stage, self.lr, self.collectives = stage, lr, collectives
        self.n, self.rank = dist.get_world_size(), dist.get_rank()
        self.name = f"ZeRO-{stage} (hand, {collectives})"
        broadcast_parameters(model)                # every rank starts from rank 0's weights
        self.module, self.meter = model, Meter()
        layers = [(parent, name, child) for parent in model.modules()
                  for name, child in parent.named_children() if isinstance(child, nn.Linear)]
        if stage == 3:
            self.layers = []
            for parent, name, child in layers:
                z = Zero3Linear(child, collectives, self.meter)
                setattr(parent, name, z)
                self.layers.append(z)
            self.state = [{} for _ in self.layers]
            return
        self.units = [_Unit(child, self.n, self.rank) for _, _, child in layers]
        if stage == 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))

    def _reduce_unit(self, unit: _Unit) -> torch.Tensor:
        flat_grad = self.meter.hold(unit.layout.flatten([p.grad for p in unit.params]))
        shard = reduce_scatter(flat_grad, self.collectives).div_(self.n)
        self.meter.free(flat_grad)
        return shard

    def _grad_ready(self, unit: _Unit) -> None:        # stage 2, inside backward
        unit.ready += 1
        if unit.ready == len(unit.params):
            unit.grad_shard = self._reduce_unit(unit)
            for p in unit.params:
                p.grad = None                      # the full gradient is freed right away
            unit.ready = 0

    @torch.no_grad()
    def step(self) -> None:
        """After ``loss.backward()``: average the gradient shards, Adam on the shards, regather."""
        if self.stage == 3:
            for layer, state in zip(self.layers, self.state):
                adam_update(layer.shard, layer.shard.grad, state, self.lr)
            return
        for unit in self.units:
            grad = self._reduce_unit(unit) if self.stage == 1 else unit.grad_shard
            mine = unit.layout.shard(unit.flat)
            adam_update(mine, grad, unit.state, self.lr)
            all_gather(mine.clone(), unit.flat, self.collectives)   # into the parameters

    def zero_grad(self) -> None:
        if self.stage == 3:
            for layer in self.layers:
                layer.shard.grad = None
            return
        for unit in self.units:
            unit.grad_shard = None
            for p in unit.params:
                p.grad = None

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by part (distinct storages), and the transient peak."""
        if self.stage == 3:
            params = [layer.shard for layer in self.layers]
            grads = [layer.shard.grad for layer in self.layers]
            states = self.state
        else:
            params = [u.flat for u in self.units]
            grads = [p.grad for u in self.units for p in u.params] if self.stage == 1 else \
                [u.grad_shard for u in self.units]
            states = [u.state for u in self.units]
        optimizer = [t for s in states for t in s.values()]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads),
                "optimizer": storage_bytes(optimizer), "buckets": 0,
                "transient": self.meter.peak}

    def full_parameters(self) -> list[torch.Tensor]:
        """(Collective.) Every parameter, full, in model order."""
        if self.stage == 3:
            return [t for layer in self.layers for t in layer.full_weight_bias()]
        return [p.detach().clone() for u in self.units for p in u.params]
