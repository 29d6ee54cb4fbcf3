"""ZeRO by hand: stages 1, 2 and 3 built from reduce-scatter and all-gather (notebook 06 §4).

It works on any model. Each module's own trainable parameters (``recurse=False``: a Linear's
weight and bias, a LayerNorm's, an Embedding's table, a bias-only module's bias, the root's own)
form one *unit*: laid end to end in one flat buffer, padded to a multiple of N and cut into N
equal shards (:class:`FlatLayout`: FSDP1's and DeepSpeed's "flat parameter"; FSDP2 shards each
parameter along dim 0 instead). Rank r owns shard r. Frozen parameters (``requires_grad=False``)
are in no unit: whole on every rank, never sent, never changed, as with DDP and FSDP2. A tied
parameter (one tensor in two modules) is one parameter. Then, per unit:

* **ZeRO-1** (optimizer state sharded) — backward fills the full ``.grad`` as usual; the step
  reduce-scatters the flattened gradient (rank r gets the sum of its shard), divides by N,
  updates its shard only (optimizer state: 1/N), and all-gathers the updated shards back into
  the full parameters. Sends: Ψ + Ψ = 2Ψ, as DDP.
* **ZeRO-2** (+ gradients sharded) — the reduce-scatter happens *during* backward, as soon as a
  unit's gradient is complete (a ``post_accumulate_grad`` hook), and the full gradient is freed
  at once: only the 1/N gradient shard stays. Sends: 2Ψ.
* **ZeRO-3** (+ parameters sharded) — a rank keeps only its shard, the module's parameter
  ``zero3_shard`` (its own parameters are gone). Before the module's forward, a hook all-gathers
  the full flat parameter through :class:`_Gather` (all-gather forward, reduce-scatter ÷ N
  backward) and sets views of it as the module's attributes; the forward runs unchanged; after
  it they are removed and the full buffer is freed (what autograd saves of it is kept as a note,
  by saved-tensor hooks). The gradient reaching the module's output triggers a second all-gather
  for its backward (one saved part needed earlier is gathered on demand); the views' gradients
  meet in :class:`_Gather`'s backward, which frees it and reduce-scatters. Sends: 3Ψ.

What cannot be sharded right is refused in ``__init__``, naming the parameter: sparse gradients,
lazy (uninitialized) parameters, one module's parameters of mixed dtypes or devices; for stage 3
a tied parameter, a parameter of a module without a forward of its own (``nn.ParameterList``) or
one its module also keeps elsewhere (``nn.LSTM``'s ``_flat_weights``). A trainable parameter
without a gradient at ``step()`` is an error (as in DDP by default), never a silent zero.

The update is Adam (default) or SGD with momentum, computed as ``torch.optim`` does
(:mod:`labkit.sharding.optim`). Collectives are the ring's two halves
(:mod:`labkit.sharding.ring`, ``collectives="ring"``) or torch's ``reduce_scatter_single`` /
``all_gather_single`` (``"dist"``). The class follows the lesson's setup protocol
(:mod:`labkit.sharding.harness`): ``module``, ``step()``, ``zero_grad()``, ``memory()``,
``full_parameters()``.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.naive import broadcast_parameters
from ..grading.references import reference
from .memory import storage_bytes
from .optim import adam_update, sgd_update
from .ring import ring_all_gather, ring_reduce_scatter

__all__ = ["FlatLayout", "reduce_scatter", "all_gather", "Meter", "HandZero"]

SHARD = "zero3_shard"            # the name of a module's shard under ZeRO-3


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
    dist.reduce_scatter_single(out, flat)
    return out


def all_gather(shard: torch.Tensor, out: torch.Tensor | None = None,
               collectives: str = "ring") -> torch.Tensor:
    """Every rank's ``shard`` end to end, in ``out`` when given (a new tensor otherwise)."""
    if collectives == "ring":
        return ring_all_gather(shard, out)
    if out is None:
        out = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_single(out, shard.clone())
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


def _refuse(qual: str, module: nn.Module, p: torch.Tensor, stage: int) -> None:
    """Raise if trainable parameter ``qual`` of ``module`` cannot be sharded at ``stage``."""
    kind = type(module).__name__
    if isinstance(p, nn.parameter.UninitializedParameter):
        raise ValueError(f"HandZero cannot shard '{qual}': it is uninitialized (a lazy {kind}). "
                         f"Run one forward pass to give it a shape, then build HandZero.")
    if p.layout != torch.strided or \
            isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
        raise ValueError(f"HandZero cannot shard '{qual}': {kind} gives it sparse gradients, "
                         f"which a flat dense buffer cannot hold. Use sparse=False.")
    if stage != 3:
        return
    if type(module).forward is nn.Module.forward:
        raise ValueError(f"ZeRO-3 cannot shard '{qual}': its module, a {kind}, has no forward "
                         f"of its own, and stage 3 gathers a module's parameters around its "
                         f"forward. Make it a parameter of the module that uses it, or use "
                         f"stage 1 or 2.")
    for key, value in vars(module).items():       # e.g. nn.LSTM's _flat_weights
        held = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else (value,)
        if key != "_parameters" and any(v is p for v in held):
            raise ValueError(f"ZeRO-3 cannot shard '{qual}': its {kind} keeps its own reference "
                             f"to it (in {key!r}), so its forward would not see the gathered "
                             f"parameter. Use stage 1 or 2.")


def _plan(model: nn.Module, stage: int):
    """The units (module, [(attribute, qualified name, parameter)]) of trainable parameters,
    in model order, and every distinct parameter in ``model.parameters()`` order; raises for
    what cannot be sharded, before anything is sent."""
    if getattr(model, "_hand_zero", False) or any(SHARD in m._parameters for m in model.modules()):
        raise ValueError("this model is already wrapped by a HandZero: build one from a fresh "
                         "model.")
    owner: dict[int, str] = {}
    units, order = [], []
    for prefix, module in model.named_modules():
        own = []
        for attr, p in module.named_parameters(recurse=False):
            qual = f"{prefix}.{attr}" if prefix else attr
            if id(p) in owner:
                if stage == 3 and p.requires_grad:
                    raise ValueError(f"ZeRO-3 cannot shard '{qual}': it is shared (tied) with "
                                     f"'{owner[id(p)]}', and stage 3 gathers a module's "
                                     f"parameters for that module's forward only. Use stage 1 "
                                     f"or 2, or untie it.")
                continue
            owner[id(p)] = qual
            order.append(p)
            if p.requires_grad:
                _refuse(qual, module, p, stage)
                own.append((attr, qual, p))
        kinds = {(p.dtype, p.device) for _, _, p in own}
        if len(kinds) > 1:
            raise ValueError(f"HandZero cannot lay {', '.join(repr(q) for _, q, _ in own)} in "
                             f"one flat buffer: their dtypes or devices differ ({kinds}).")
        if own and sum(p.numel() for _, _, p in own):
            units.append((module, own))
    return units, order


class _Unit:
    """One module's own trainable parameters: a flat layout, and the shard's optimizer state."""

    def __init__(self, module: nn.Module, own: list, n: int, rank: int) -> None:
        self.module = module
        self.attrs = [attr for attr, _, _ in own]
        self.names = [qual for _, qual, _ in own]
        self.layout = FlatLayout([p.shape for _, _, p in own], n, rank)
        self.state: dict = {}
        self.params: list[torch.Tensor] = []         # stages 1, 2: views into self.flat
        self.flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.ready = 0
        self.shard: nn.Parameter | None = None       # stage 3
        self.gathered: torch.Tensor | None = None    # stage 3, during the module's forward
        self.regathered: torch.Tensor | None = None  # stage 3, for its backward
        self.saving = None                           # stage 3: the saved-tensor hooks in force


class _Saved:
    """What autograd keeps of a saved view of a unit's full parameters: where it lay."""

    def __init__(self, unit: _Unit, t: torch.Tensor) -> None:
        self.unit, self.size, self.stride, self.offset = \
            unit, t.size(), t.stride(), t.storage_offset()


class _Call:
    """One forward of a ZeRO-3 unit: which of its parameters got a gradient."""

    def __init__(self, k: int) -> None:
        self.seen = [False] * k

    def mark(self, i: int):
        def hook(grad):
            self.seen[i] = True
        return hook


class _Gather(torch.autograd.Function):
    """ZeRO-3's link from a unit's shard to its full parameters: all-gather forward;
    backward, the full gradient reduce-scattered and divided by N (the average)."""

    @staticmethod
    def forward(ctx, shard, zero, unit, call):
        ctx.zero, ctx.unit, ctx.call = zero, unit, call
        return zero.meter.hold(all_gather(shard.detach(), collectives=zero.collectives))

    @staticmethod
    def backward(ctx, grad_full):
        zero, unit = ctx.zero, ctx.unit
        missing = [name for name, seen in zip(unit.names, ctx.call.seen) if not seen]
        if missing:
            raise RuntimeError(zero._no_gradient(missing))
        grad_full = zero.meter.hold(grad_full.contiguous())
        zero._release(unit)                         # the module's backward is done with it
        grad = reduce_scatter(grad_full, zero.collectives).div_(zero.n)
        zero.meter.free(grad_full)
        return grad, None, None, None


def _tensors(obj):
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class HandZero:
    """ZeRO stage 1, 2 or 3 by hand over every trainable parameter of a model.

    Args:
        model: the model (each rank's own; rank 0's parameters and buffers are broadcast first).
        stage: 1, 2 or 3.
        lr: the learning rate.
        collectives: ``"ring"`` (the ring's two halves, isend/irecv) or ``"dist"``.
        optimizer: ``"adam"`` (betas 0.9/0.999, eps 1e-8, like ``torch.optim.Adam``) or
            ``"sgd"`` (like ``torch.optim.SGD(lr=lr, momentum=momentum)``).
        momentum: SGD's momentum.
    """

    @reference
    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-2,
                 collectives: str = "ring", optimizer: str = "adam",
                 momentum: float = 0.0) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}.")
        if collectives not in ("ring", "dist"):
            raise ValueError(f"collectives must be 'ring' or 'dist', got {collectives!r}.")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
        plan, order = _plan(model, stage)
        self.stage, self.lr, self.collectives = stage, lr, collectives
        self.optimizer, self.momentum = optimizer, momentum
        self.n, self.rank = dist.get_world_size(), dist.get_rank()
        self.name = f"ZeRO-{stage} (hand, {collectives}{'' if optimizer == 'adam' else ', SGD'})"
        broadcast_parameters(model)                # every rank starts from rank 0's weights
        self.module, self.meter = model, Meter()
        model._hand_zero = True
        self.units = [_Unit(module, own, self.n, self.rank) for module, own in plan]
        where = {id(p): (unit, i) for unit, (_, own) in zip(self.units, plan)
                 for i, (_, _, p) in enumerate(own)}
        # model order: (unit, index) of a trainable parameter, (None, tensor) of a frozen one
        self.order = [where.get(id(p), (None, p)) for p in order]
        self.frozen = [p for unit, p in self.order if unit is None]
        self._live: dict[int, _Unit] = {}            # storage -> unit, during its forward
        for unit, (_, own) in zip(self.units, plan):
            params = [p for _, _, p in own]
            flat = unit.layout.flatten([p.detach() for p in params])
            if stage == 3:
                self._shard(unit, flat)
                continue
            unit.flat, unit.params = flat, params
            for p, view in zip(params, unit.layout.views(flat)):
                p.data = view                      # the parameters now live in unit.flat
                if stage == 2:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))

    # ------------------------------------------------------------------ stage 3: hooks
    def _shard(self, unit: _Unit, flat: torch.Tensor) -> None:
        module = unit.module
        unit.shard = nn.Parameter(unit.layout.shard(flat).clone())   # the full flat goes away
        for attr in unit.attrs:
            delattr(module, attr)
        module.register_parameter(SHARD, unit.shard)
        module.register_forward_pre_hook(partial(self._before_forward, unit), prepend=True)
        module.register_forward_hook(partial(self._after_forward, unit), always_call=True)

    def _before_forward(self, unit: _Unit, module: nn.Module, args) -> None:
        self._release(unit)                        # left by a backward that did not reach it
        call = _Call(len(unit.attrs))
        full = _Gather.apply(unit.shard, self, unit, call)
        views = unit.layout.views(full)
        for i, (attr, view) in enumerate(zip(unit.attrs, views)):
            setattr(module, attr, view)
            if view.requires_grad:
                view.register_hook(call.mark(i))
        unit.gathered = full
        self._live[full.untyped_storage().data_ptr()] = unit
        unit.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        unit.saving.__enter__()

    def _after_forward(self, unit: _Unit, module: nn.Module, args, output) -> None:
        if unit.saving is None:                    # the pre-hook did not get that far
            return
        unit.saving.__exit__(None, None, None)
        unit.saving = None
        for attr in unit.attrs:
            module.__dict__.pop(attr, None)
        self._live.pop(unit.gathered.untyped_storage().data_ptr(), None)
        self.meter.free(unit.gathered)
        unit.gathered = None                       # nothing keeps the full parameters now
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._before_backward, unit))

    def _before_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        self._regather(unit)

    def _pack(self, t: torch.Tensor):
        if self._live and type(t) is torch.Tensor and t.layout == torch.strided:
            unit = self._live.get(t.untyped_storage().data_ptr())
            if unit is not None:
                return _Saved(unit, t)
        return t

    def _unpack(self, saved):
        if isinstance(saved, _Saved):
            full = self._regather(saved.unit)
            return full.as_strided(saved.size, saved.stride, saved.offset)
        return saved

    def _regather(self, unit: _Unit) -> torch.Tensor:
        if unit.regathered is None:
            unit.regathered = self.meter.hold(all_gather(unit.shard.detach(),
                                                         collectives=self.collectives))
        return unit.regathered

    def _release(self, unit: _Unit) -> None:
        """Free the unit's full parameters gathered for backward, if any."""
        if unit.regathered is not None:
            self.meter.free(unit.regathered)
            unit.regathered = None

    # ------------------------------------------------------------------ stages 1, 2
    def _reduce_unit(self, unit: _Unit) -> torch.Tensor:
        flat_grad = self.meter.hold(unit.layout.flatten([p.grad for p in unit.params]))
        shard = reduce_scatter(flat_grad, self.collectives).div_(self.n)
        self.meter.free(flat_grad)
        return shard

    def _grad_ready(self, unit: _Unit) -> None:        # stage 2, inside backward
        unit.ready += 1
        if unit.ready == len(unit.params):
            shard = self._reduce_unit(unit)
            unit.grad_shard = shard if unit.grad_shard is None else unit.grad_shard.add_(shard)
            for p in unit.params:
                p.grad = None                      # the full gradient is freed right away
            unit.ready = 0

    # ------------------------------------------------------------------ the protocol
    def _no_gradient(self, names: list[str]) -> str:
        return (f"{', '.join(repr(n) for n in names)}: trainable, but got no gradient in this "
                f"step's backward (rank {self.rank}). HandZero averages and updates every "
                f"trainable parameter every step, as DDP does by default: use it in the "
                f"forward, or freeze it (requires_grad_(False)) before building HandZero.")

    def _missing(self) -> list[str]:
        if self.stage == 3:
            return [name for u in self.units if u.shard.grad is None for name in u.names]
        return [name for u in self.units
                if self.stage == 1 or u.ready or u.grad_shard is None
                for name, p in zip(u.names, u.params) if p.grad is None]

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        if self.optimizer == "adam":
            adam_update(param, grad, state, self.lr)
        else:
            sgd_update(param, grad, state, self.lr, self.momentum)

    @torch.no_grad()
    @reference
    def step(self) -> None:
        """After ``loss.backward()``: average the gradient shards, update the shards, regather."""
        missing = self._missing()                  # every rank raises before sending anything
        if missing:
            raise RuntimeError(self._no_gradient(missing))
        for unit in self.units:
            if self.stage == 3:
                self._release(unit)
                self._update(unit.shard, unit.shard.grad, unit.state)
                continue
            grad = self._reduce_unit(unit) if self.stage == 1 else unit.grad_shard
            mine = unit.layout.shard(unit.flat)
            self._update(mine, grad, unit.state)
            all_gather(mine.clone(), unit.flat, self.collectives)   # into the parameters

    def zero_grad(self) -> None:
        for unit in self.units:
            if self.stage == 3:
                unit.shard.grad = None
                continue
            unit.grad_shard, unit.ready = None, 0
            for p in unit.params:
                p.grad = None

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by part (distinct storages), and the transient peak.
        Frozen parameters count as parameters: every rank holds them whole."""
        if self.stage == 3:
            params = [u.shard for u in self.units]
            grads = [u.shard.grad for u in self.units]
        else:
            params = [u.flat for u in self.units]
            grads = [p.grad for u in self.units for p in u.params] if self.stage == 1 else \
                [u.grad_shard for u in self.units]
        optimizer = [t for u in self.units for t in u.state.values()]
        return {"params": storage_bytes(params + self.frozen), "grads": storage_bytes(grads),
                "optimizer": storage_bytes(optimizer), "buckets": 0,
                "transient": self.meter.peak}

    def full_parameters(self) -> list[torch.Tensor]:
        """(Collective.) Every parameter, frozen ones too, full, in ``model.parameters()``
        order as it was before HandZero (a tied parameter once)."""
        if self.stage == 3:
            full = {id(u): u.layout.views(all_gather(u.shard.detach(),
                                                     collectives=self.collectives))
                    for u in self.units}
        else:
            full = {id(u): u.params for u in self.units}
        return [(frozen if unit is None else full[id(unit)][frozen]).detach().clone()
                for unit, frozen in self.order]
