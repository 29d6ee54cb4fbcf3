"""Counting what a rank sends: every collective it issues, with its size (notebook 06 §3-§8).

The issue with "ZeRO-3 sends 1.5x what DDP sends" is that it is usually *computed*. Here it is
*counted*: :class:`CommCounter` is a ``TorchDispatchMode``, so it sees every ``torch.distributed``
operation that reaches PyTorch's dispatcher in this rank — DDP's bucket all-reduces from inside
its C++ reducer, FSDP2's all-gathers and reduce-scatters, ``ZeroRedundancyOptimizer``'s
broadcasts, tensor parallelism's functional all-reduces and the ``isend``/``irecv`` of a
hand-written ring — whoever issued them (``tests/sharding/test_sharding.py`` checks each). The code under
test cannot skip the count.

For each call it records the kind, the payload ``S`` (the bytes of the whole tensor being
reduced or gathered), the group's size ``n`` and the current ``label``. Two totals come out:

* **volume** in ZeRO's units: all-reduce ``2S`` (a reduce-scatter and an all-gather), all-gather
  ``S``, reduce-scatter ``S``, broadcast ``S`` (collectives only: a hand-written ring's sends
  are counted as what they are, bytes sent). DDP moves 2Ψ per step, ZeRO-3 3Ψ.
* **ring bytes sent** per rank: what a ring implementation puts on this rank's link —
  all-reduce ``2(n-1)/n·S``, all-gather and reduce-scatter ``(n-1)/n·S`` each (notebook 03's
  two halves), broadcast ``(n-1)/n·S`` on average over the ranks (a chain: every rank but the
  last forwards ``S``), point-to-point sends exactly as sent.

Example (inside a rank)::

    with CommCounter() as comm:
        loss.backward()
    comm.totals()           # {'all_reduce': {'calls': 1, 'bytes': 29248, ...}}
    comm.volume()           # 58496 = 2 * 29248
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CommCounter", "VOLUME", "KINDS"]

# op name (without namespace and overload) -> kind of collective
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
    "all_to_all_single": "all_to_all", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
}
VOLUME = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0,
          "all_to_all": 1.0}    # ZeRO's units, multiples of the payload S (collectives only)
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_IGNORED = ("wait_tensor", "_wait_tensor", "_wrap_tensor_autograd")   # bookkeeping, no data


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group(func, args, kwargs) -> tuple[int, tuple[int, ...]]:
    """(size, global ranks) of the process group the operation runs on."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **(kwargs or {}))
    group = None
    try:
        if "group_name" in bound:
            group = _resolve_process_group(bound["group_name"])
        elif bound.get("process_group") is not None:
            group = dist.ProcessGroup.unbox(bound["process_group"])
        if group is not None:
            return group.size(), tuple(get_process_group_ranks(group))
    except Exception:  # noqa: BLE001  (an unusual group object: size from the schema or world)
        pass
    if "group_size" in bound:
        return int(bound["group_size"]), ()
    n = dist.get_world_size() if dist.is_initialized() else 1
    return n, tuple(range(n))


def _payload(kind: str, func, args, kwargs, n: int) -> int:
    """S: the bytes of the whole tensor the collective is about (gathered or reduced)."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **(kwargs or {}))
    tensors = lambda key: [t for t in tree_leaves(bound.get(key)) if isinstance(t, torch.Tensor)]  # noqa: E731
    if kind == "all_gather":
        out = (tensors("output_tensor") or tensors("output_tensors") or tensors("outputs")
               or tensors("out"))
        if out:
            return _nbytes(out)
        return _nbytes(tensors("input") or tensors("input_tensors") or tensors("inputs")) * n
    if kind == "reduce_scatter":
        return _nbytes(tensors("input_tensor") or tensors("input_tensors") or tensors("input")
                       or tensors("inputs"))
    every = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return _nbytes(every)


class CommCounter(TorchDispatchMode):
    """Count every collective and point-to-point message this rank issues inside the block.

    Attributes:
        calls: one dict per operation: ``kind``, ``bytes`` (payload S), ``group_size``,
            ``group_ranks`` (global ranks of the group), ``label``, ``t``
            (``time.perf_counter()`` when it was issued).
        label: set it to tag the calls that follow (``"layer 0 forward"``, ``"step"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []
        self.label = ""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless told not to;
        # that imports torch._dynamo (seconds, in every fresh rank). This mode never runs under
        # torch.compile, so the wrapper is not needed.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _NAMESPACES:
            op = func._schema.name.split("::")[-1]
            if op not in _IGNORED:
                kind = KINDS.get(op, op)
                n, ranks = _group(func, args, kwargs)
                self.calls.append({"kind": kind, "bytes": _payload(kind, func, args, kwargs, n),
                                   "group_size": n, "group_ranks": ranks, "label": self.label,
                                   "t": time.perf_counter()})
        return func(*args, **(kwargs or {}))

    def clear(self) -> None:
        """Forget what was counted (keep counting)."""
        self.calls = []

    def totals(self, by: str = "kind") -> dict[str, dict]:
        """``{kind: {"calls", "bytes", "volume", "ring_sent"}}`` (or grouped ``by="label"``)."""
        out: dict[str, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "volume": 0.0,
                                                    "ring_sent": 0.0})
        for c in self.calls:
            row = out[c[by]]
            row["calls"] += 1
            row["bytes"] += c["bytes"]
            row["volume"] += _volume(c)
            row["ring_sent"] += _ring_sent(c)
        return dict(out)

    def volume(self, label: str | None = None) -> float:
        """Bytes in ZeRO's units (all-reduce = 2S, all-gather = reduce-scatter = S)."""
        return sum(_volume(c) for c in self.calls if label is None or c["label"] == label)

    def ring_sent(self, label: str | None = None) -> float:
        """Bytes this rank's link carries when every collective is a ring (sends: as sent)."""
        return sum(_ring_sent(c) for c in self.calls if label is None or c["label"] == label)

    def kinds(self) -> list[str]:
        """The kinds of operation seen, in order of first use."""
        return list(dict.fromkeys(c["kind"] for c in self.calls))


def _volume(call: dict) -> float:
    return VOLUME.get(call["kind"], 0.0) * call["bytes"]


def _ring_sent(call: dict) -> float:
    n, s, kind = call["group_size"], call["bytes"], call["kind"]
    if kind == "send":
        return float(s)
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * s
    if kind in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        return (n - 1) / n * s
    return 0.0
