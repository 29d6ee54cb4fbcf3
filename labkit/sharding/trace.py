"""One training step on a timeline, from a real ``torch.profiler`` trace (notebook 06 §9).

:func:`traced_step` runs in every rank: it builds the setup (FSDP2 ``fully_shard`` per layer,
or DDP with small buckets as in notebook 02), trains one untraced step, waits at a barrier,
then records one step (forward, backward, optimizer) with ``torch.profiler``. From the trace
it keeps, as :mod:`labkit.common.timeline` spans (``lk.plots.timeline`` draws them):

* ``compute`` lane: each layer's forward (``aten::linear``), each backward matmul node
  (``AddmmBackward0``) and the optimizer step;
* ``comm`` lane: the collectives as gloo's own threads ran them (``gloo:all_gather``,
  ``gloo:all_reduce``), each matched, in issue order, to the ``c10d`` call that asked for it:
  FSDP2's per-layer all-gathers and reduce-scatters, DDP's bucket all-reduces.

On gloo (torch 2.13) a reduce-scatter (``reduce_scatter_single``) runs as ``gloo:all_reduce`` inside the
``c10d::_reduce_scatter_base_`` call: gloo has no reduce-scatter of its own for this call, so
the wire carries a whole all-reduce (``tests/claims/test_claims_sharding.py``). The span keeps the
name of what was asked for, ``reduce_scatter``.

Times are each rank's own, from the start of its trace, right after the barrier.
"""
from __future__ import annotations

import re

import torch.distributed as dist
import torch.nn.functional as F

from .model import make_mlp, rank_batch

__all__ = ["traced_step", "TRACE_DIMS", "collective_counts"]

TRACE_DIMS = (256, 256, 256, 256)        # 3 layers of 257 KB: big enough to see each transfer
_COMM_CALLS = {"c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
               "c10d::_reduce_scatter_base_": "reduce_scatter",
               "c10d::reduce_scatter_": "reduce_scatter", "c10d::allreduce_": "all_reduce",
               "c10d::broadcast_": "broadcast"}
_LAYER = re.compile(r"\((\d+)\)")


def _setup(kind: str, model, dims):
    from .library import TorchDDP, TorchFSDP
    if kind == "FSDP2":
        return TorchFSDP(model, lr=1e-3, reshard_after_forward=True)
    if kind == "DDP":
        layer_mb = (dims[0] * dims[1] + dims[1]) * 4 / 2**20
        return TorchDDP(model, lr=1e-3, bucket_cap_mb=layer_mb * 0.9)   # about a bucket a layer
    raise ValueError(f"traced_step traces 'FSDP2' or 'DDP', got {kind!r}.")


def _fsdp_module(event) -> int | None:
    """The index, in the model, of the FSDP module whose hook issued this call (``(2)``)."""
    parent = event
    while parent is not None:
        m = _LAYER.search(parent.name) if parent.name.startswith("FSDP::") else None
        if m:
            return int(m.group(1))
        parent = parent.cpu_parent
    return None


def _spans(rank: int, events) -> list[dict]:
    events = sorted(events, key=lambda e: e.time_range.start)
    t0 = min(e.time_range.start for e in events) if events else 0.0
    sec = lambda us: (us - t0) / 1e6  # noqa: E731
    spans, calls = [], []
    n_forward = n_backward = 0
    for e in events:
        if e.name in _COMM_CALLS:
            calls.append((_COMM_CALLS[e.name], _fsdp_module(e)))
        elif e.name == "aten::linear":
            spans.append(_span(rank, "compute", "forward", f"L{n_forward}", sec, e))
            n_forward += 1
        elif e.name.endswith("AddmmBackward0") and e.name.startswith("autograd::engine"):
            spans.append(_span(rank, "compute", "backward", "", sec, e))
            n_backward += 1
        elif e.name.startswith("Optimizer.step"):
            spans.append(_span(rank, "compute", "step", "Adam", sec, e))
    # FSDP names modules by their index in the model (0, 2, 4: Linear, Tanh, Linear ...);
    # the layers are numbered L0, L1, ... like the forward spans
    order = {m: f"L{i}" for i, m in enumerate(sorted({m for _, m in calls if m is not None}))}
    gloo = [e for e in events if e.name.startswith("gloo:")]
    buckets = 0
    for i, e in enumerate(gloo):
        kind, module = calls[i] if i < len(calls) else (e.name[5:], None)
        label = order.get(module, f"#{i}")
        if module is None and kind == "all_reduce":      # DDP: one all-reduce per bucket
            label, buckets = f"b{buckets}", buckets + 1
        spans.append(_span(rank, "comm", kind, label, sec, e))
    return spans


def _span(rank, lane, kind, label, sec, e) -> dict:
    return {"rank": rank, "lane": lane, "kind": kind, "label": label,
            "start": sec(e.time_range.start), "end": sec(e.time_range.end)}


def traced_step(rank: int, world_size: int, kind: str = "FSDP2", dims=TRACE_DIMS,
                per_rank: int = 32) -> list[dict]:
    """(In a rank.) One step of ``kind`` (``"FSDP2"`` or ``"DDP"``) traced; its spans."""
    from torch.profiler import ProfilerActivity, profile

    setup = _setup(kind, make_mlp(dims, seed=rank), dims)
    x, y = rank_batch(rank, world_size, per_rank, dims)

    def step():
        F.mse_loss(setup.module(x), y).backward()
        setup.step()
        setup.zero_grad()

    step()                                    # warm-up: state allocated; DDP rebuilds its
    step()                                    # buckets (2 broadcasts) in the second forward
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return _spans(rank, list(prof.events()))


def collective_counts(per_rank_spans: list[list[dict]]) -> list[dict[str, int]]:
    """Per rank, how many collectives of each kind the trace shows."""
    out = []
    for spans in per_rank_spans:
        counts: dict[str, int] = {}
        for s in spans:
            if s["lane"] == "comm":
                counts[s["kind"]] = counts.get(s["kind"], 0) + 1
        out.append(counts)
    return out
