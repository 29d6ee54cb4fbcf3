"""What a rank process holds, and which classes live in it, counted where an answer cannot hide.

An exercise checker that asks "does this answer keep only its shard?" or "did it shard by hand,
without the library?" cannot trust the answer's own attributes: state fits in a closure, a
default argument, a class attribute, a module global, a tensor's own attributes or hooks, an
autograd graph kept alive. A :class:`Census` looks at the whole process instead. Used inside a
rank (an ``lk.run`` job)::

    with Census() as census:                  # the baseline: what is alive now is left out
        answer = cloudpickle.loads(blob)      # load the answer AFTER the baseline
        ... build the model, run the answer ...
        held = census.held(exclude=[model, x, y, records])   # what the rest of the process holds
        held.elements()                       # in fp32 elements (bytes / 4)
        census.instances(LIBRARY)             # ['ZeroRedundancyOptimizer'] when one is alive
        census.optimizers()                   # [('Adam', 758)]: optimizers and their state

How. ``gc.freeze()`` moves every object alive at the baseline to the collector's permanent
generation, so ``gc.get_objects()`` afterwards returns exactly the container objects created
since (tensors, storages, autograd nodes, closures' cells, dicts, lists, instances; cheap, since
the thousands of objects of ``import torch`` are left out). :meth:`Census.held` adds up:

* the distinct **storages** behind every new tensor (a view counts its whole storage), the
  ``.grad`` of each beyond its owner's own size, and the tensors **saved in autograd graphs**
  that a kept tensor or node keeps alive (``_saved_*``, a custom Function's saved tensors);
* new ``UntypedStorage``/``TypedStorage`` objects, and the **NumPy arrays, bytes, bytearrays,
  arrays and floats** that new objects refer to (8 bytes per float).

``exclude`` names what the checker itself holds (the model, the inputs, its records): a tensor
there is allowed its own bytes in its storage (the rest of a larger storage still counts), a
container there is left out with everything it holds, a module with its parameters and buffers.

Limits, said plainly: memory that only C++ holds without a Python object (a pending ``Work``'s
buffers, a store, a file, another process) is not seen, nor an untracked object (a NumPy array,
bytes) attached to an object that existed before the baseline (a class or module loaded before
it); load the answer after the baseline. An answer that calls ``gc.freeze()``/``gc.unfreeze()``
could hide objects, so the census then refuses (:class:`CensusError`): the case cannot be
verified and fails.
"""
from __future__ import annotations

import gc
import time
import types
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["Census", "CensusError", "Held", "LIBRARY"]

#: torch's own sharding classes (any class with one of these in its MRO, by name)
LIBRARY = ("ZeroRedundancyOptimizer", "DistributedDataParallel", "FullyShardedDataParallel",
           "FSDPModule", "DTensor", "DeviceMesh", "ParallelStyle")

_BYTES_LIKE = (bytes, bytearray, memoryview)


class CensusError(RuntimeError):
    """The census cannot be trusted (the collector's frozen generation was changed)."""


@dataclass
class Held:
    """Bytes held by objects created since the baseline: ``tensors`` (storages, graphs, grads),
    ``other`` (NumPy arrays, bytes, arrays, Python floats)."""

    tensors: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.tensors + self.other

    def elements(self, element_size: int = 4) -> int:
        """``total`` in elements of ``element_size`` bytes (fp32 by default)."""
        return self.total // element_size


class Census:
    """A baseline of the live objects of this process, then counts of what was made since.

    A context manager: ``__enter__`` collects garbage and freezes what is alive (the baseline),
    ``__exit__`` unfreezes it (and, in a process that had frozen objects before, such as an
    ``lk.run`` rank, collects and freezes what is left, as it found it). Methods may be called
    any number of times inside.
    """

    def __enter__(self) -> "Census":
        self._was_frozen = gc.get_freeze_count() > 0   # lk.run's ranks freeze what they start with
        gc.collect()
        self._old = []              # sentinels: frozen (never seen again) and young (always seen)
        gc.freeze()
        self._young = []
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()
        if self._was_frozen:        # leave the rank as found: its long-lived objects frozen
            gc.collect()
            gc.freeze()

    def objects(self) -> list:
        """Every live container object created since the baseline (after a collection)."""
        gc.collect()
        objects = gc.get_objects()
        ids = {id(o) for o in objects}
        if id(self._old) in ids or id(self._young) not in ids:
            raise CensusError("the census cannot see what this rank holds: gc.freeze() or "
                              "gc.unfreeze() was called since its baseline (that hides objects "
                              "from it), so the case cannot be verified")
        return [o for o in objects if o is not self._young]

    def held(self, exclude: Iterable = (), settle_s: float = 0.05) -> Held:
        """Bytes held by what was made since the baseline, less ``exclude`` (module doc).

        A buffer a finished collective used stays alive until the backend's worker thread
        lets go of its ``Work`` (a moment later; torch keeps the Python tensor alive with it),
        so the count is taken again over ``settle_s`` and the smallest is returned: what stays
        is held."""
        exclude = list(exclude)
        best = self._held_once(exclude)
        deadline = time.perf_counter() + settle_s
        while best.total and time.perf_counter() < deadline:
            time.sleep(settle_s / 4)
            now = self._held_once(exclude)
            best = now if now.total < best.total else best
        return best

    def _held_once(self, exclude: list) -> Held:
        budget, skip = _excluded(exclude)
        skip.add(id(budget))
        tensors: dict[int, torch.Tensor] = {}
        storages: dict[tuple, int] = {}
        nodes, others, seen = [], {}, set()
        for o in self.objects():
            if id(o) in skip or isinstance(o, types.FrameType):
                continue
            if isinstance(o, torch.Tensor):
                tensors[id(o)] = o
            elif isinstance(o, torch.autograd.graph.Node):
                nodes.append(o)
            elif isinstance(o, (torch.UntypedStorage, torch.TypedStorage)):
                s = o.untyped_storage() if isinstance(o, torch.TypedStorage) else o
                if s.data_ptr():
                    storages[(str(s.device), s.data_ptr())] = s.nbytes()
            _referred(o, tensors, others, seen, skip)
        for t in list(tensors.values()):
            if t.grad_fn is not None:
                nodes.append(t.grad_fn)
        for t in _saved_tensors(nodes):
            tensors.setdefault(id(t), t)
        for t in tensors.values():
            key = _key(t)
            if key is None:
                continue
            storages[key] = _nbytes(t)
            grad = t.grad
            if grad is not None and _key(grad) is not None and _key(grad) != key:
                gkey = _key(grad)
                storages[gkey] = _nbytes(grad)
                budget[gkey] = budget.get(gkey, 0) + min(_nbytes(t), _nbytes(grad))
        held = sum(max(0, n - budget.get(k, 0)) for k, n in storages.items())
        return Held(held, sum(others.values()))

    def instances(self, names: Iterable[str] = LIBRARY) -> list[str]:
        """Names of the classes in ``names`` that a new object is (or derives from)."""
        wanted, found = tuple(names), set()
        for o in self.objects():
            for cls in type(o).__mro__:
                if cls.__name__ in wanted:
                    found.add(cls.__name__)
        return sorted(found)

    def optimizers(self) -> list[tuple[str, int]]:
        """``(class name, elements with state)`` for each new optimizer-like object holding
        state: a ``state`` dict keyed by tensors with non-empty entries (``torch.optim``'s and
        ``labkit.sharding.optim``'s optimizers, and their subclasses)."""
        out = []
        for o in self.objects():
            attrs = getattr(o, "__dict__", None)
            state = attrs.get("state") if isinstance(attrs, dict) else None
            if not isinstance(state, dict):
                continue
            numel = sum(k.numel() for k, v in list(state.items())
                        if isinstance(k, torch.Tensor) and v)
            if numel:
                out.append((type(o).__name__, numel))
        return out


# ---------------------------------------------------------------- helpers
def _excluded(roots: Iterable) -> tuple[dict[tuple, int], set[int]]:
    """(allowed bytes per storage, ids of excluded containers) for ``exclude``."""
    budget: dict[tuple, int] = {}
    skip: set[int] = set()
    counted: set[int] = set()

    def allow(t: torch.Tensor) -> None:
        if id(t) in counted:
            return
        counted.add(id(t))
        skip.add(id(t))
        key = _key(t)
        if key is not None:
            budget[key] = budget.get(key, 0) + t.numel() * t.element_size()

    def walk(o, depth: int) -> None:
        if depth < 0 or o is None or id(o) in skip:
            return
        if isinstance(o, torch.Tensor):
            allow(o)
            if o.grad is not None:
                allow(o.grad)
            return
        if isinstance(o, torch.nn.Module):
            skip.add(id(o))
            for t in list(o.parameters()) + list(o.buffers()):
                walk(t, depth - 1)
            return
        if isinstance(o, dict):
            skip.add(id(o))
            for v in list(o.values()):
                walk(v, depth - 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            skip.add(id(o))
            for v in list(o):
                walk(v, depth - 1)
    for root in roots:
        walk(root, 8)
    return budget, skip


def _key(t: torch.Tensor) -> tuple | None:
    """The storage behind ``t`` (a DTensor's local shard's), or None (no plain storage)."""
    inner = getattr(t, "_local_tensor", None)
    t = inner if isinstance(inner, torch.Tensor) else t
    try:
        s = t.untyped_storage()
    except Exception:  # noqa: BLE001  (sparse, meta, functional wrappers: no storage of their own)
        return None
    return (str(s.device), s.data_ptr()) if s.data_ptr() else None


def _nbytes(t: torch.Tensor) -> int:
    inner = getattr(t, "_local_tensor", None)
    t = inner if isinstance(inner, torch.Tensor) else t
    return t.untyped_storage().nbytes()


def _referred(o, tensors: dict, others: dict, seen: set, skip: set) -> None:
    """Note the tensors, floats, bytes and arrays ``o`` refers to, looking inside the tuples
    and dicts the collector does not track (those holding only atomic objects)."""
    for r in gc.get_referents(o):
        if id(r) in seen or id(r) in skip:
            continue
        seen.add(id(r))
        if isinstance(r, torch.Tensor):
            tensors[id(r)] = r
        elif type(r) is float:
            others[id(r)] = 8
        elif isinstance(r, _BYTES_LIKE):
            others[id(r)] = r.nbytes if isinstance(r, memoryview) else len(r)
        elif _is_array(r):
            others[("array", _array_base(r))] = r.nbytes
        elif isinstance(r, (tuple, dict)) and not gc.is_tracked(r):
            _referred(r, tensors, others, seen, skip)


def _is_array(o) -> bool:
    module = type(o).__module__
    return (module == "numpy" and hasattr(o, "nbytes")) or module == "array"


def _array_base(a) -> int:
    if type(a).__module__ == "array":
        return id(a)
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return id(a)


def _saved_tensors(nodes: list) -> list[torch.Tensor]:
    """The tensors that autograd graphs from ``nodes`` keep alive (saved for backward)."""
    found, seen, todo = [], set(), list(nodes)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names = [a for a in dir(node) if a.startswith("_saved_")] + ["variable", "saved_tensors"]
        for name in names:
            try:
                value = getattr(node, name)
            except Exception:  # noqa: BLE001  (freed after backward, or not this node's)
                continue
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, torch.Tensor):
                    found.append(v)
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()) or ())
    return found
