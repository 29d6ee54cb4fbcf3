"""Pipeline schedules with ``torch.distributed.pipelining``: bubble and activation memory, measured
(notebook 07 §11; notebook 01 §3 built a 2-stage pipeline by hand).

p ranks each hold a stage of an MLP; a batch is cut into m micro-batches. The schedules:

* **GPipe** — all m forwards, then all m backwards: every stage keeps the activations of all m
  micro-batches until their backward;
* **1F1B** — after a warm-up of (p - s) forwards, stage s alternates one forward, one backward,
  so it keeps at most ``min(m, p - s)`` micro-batches' activations; same bubble as GPipe;
* **interleaved 1F1B** — each rank holds v stages (here v = 2, placed round-robin), which
  shrinks the bubble by v at the price of v times more messages.

The textbook bubble (idle share of a step, compute costs equal per stage)::

    GPipe, 1F1B:       (p - 1) / (m + p - 1)
    interleaved (v):   (p - 1) / (v·m + p - 1)

:func:`measure_pipeline` runs each schedule on real ranks and measures, per rank, the time spent
in forward and backward of its stage(s) (autograd markers around each stage), the step time
(slowest rank), so ``bubble = 1 - busy / step``, and the peak bytes of activations saved for
backward (``torch.autograd.graph.saved_tensors_hooks``), in units of one micro-batch's. On a
CPU the messages between stages (gloo, ~ms each) and the shared cores add to the bubble: the
formula assumes free communication and one device per stage.

Example::

    pipe = lk.scaling.measure_pipeline(world_size=2, micro_batches=4)
    print(lk.scaling.pipeline_table(pipe))
"""
from __future__ import annotations

import statistics
import time
import weakref

import torch
from torch import nn

from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, slowest_runs

__all__ = ["SCHEDULES", "bubble_formula", "memory_formula", "measure_pipeline",
           "pipeline_table"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def bubble_formula(schedule: str, p: int, m: int, v: int = 2) -> float:
    """The textbook idle share of a step (a FORMULA: equal stages, free communication)."""
    vm = v * m if schedule == "Interleaved1F1B" else m
    return (p - 1) / (vm + p - 1)


def memory_formula(schedule: str, p: int, m: int, rank: int) -> int:
    """Micro-batches whose activations rank ``rank`` holds at its peak (a FORMULA)."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, p - rank)
    return min(2 * m, 2 * (p - rank) + p - 1)   # interleaved, v=2: its warm-up (Megatron's)


class _Mark(torch.autograd.Function):
    """Identity whose backward notes the time (the edges of a stage's backward)."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock()
        return grad, None


class _Timed(nn.Module):
    """A stage that records its forward and backward spans into ``spans``."""

    def __init__(self, inner: nn.Module, spans: list, name: str) -> None:
        super().__init__()
        self.inner, self.spans, self.name = inner, spans, name
        self._open: dict | None = None
        for p in inner.parameters():   # a stage without input grad ends at its params' grads
            p.register_post_accumulate_grad_hook(lambda _p: self._touch())

    def _begin_backward(self) -> None:
        self._open = {"kind": "backward", "label": self.name, "start": time.perf_counter()}
        self._open["end"] = self._open["start"]
        self.spans.append(self._open)

    def _touch(self) -> None:
        if self._open is not None:
            self._open["end"] = time.perf_counter()

    def forward(self, x):
        self._open = None
        t0 = time.perf_counter()
        if x.requires_grad:
            x = _Mark.apply(x, self._touch)
        y = self.inner(x)
        self.spans.append({"kind": "forward", "label": self.name, "start": t0,
                           "end": time.perf_counter()})
        return _Mark.apply(y, self._begin_backward)


class _SavedBytes:
    """Live and peak bytes of the activations autograd saves for backward, in this thread
    (saved parameters, e.g. a Linear's weight for the input's gradient, are not activations)."""

    def __init__(self, params=()) -> None:
        self.live = self.peak = 0
        self.skip = {p.untyped_storage().data_ptr() for p in params}

    def _free(self, n: int) -> None:
        self.live -= n

    def pack(self, t):
        holder = _Holder(t)
        if t.untyped_storage().data_ptr() in self.skip:
            return holder
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, n)
        return holder

    @staticmethod
    def unpack(holder):
        return holder.t


class _Holder:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _pipeline_rank(rank, world_size, schedules, micro_batches, width, blocks, batch_size,
                   steps):
    import torch.distributed as dist
    import torch.distributed.pipelining as pp
    import torch.nn.functional as F

    from ..common.models import mlp
    p, out = world_size, {}
    for name in schedules:
        v = 2 if name == "Interleaved1F1B" else 1
        whole = mlp(width, p * v * blocks, seed=3)
        spans: list = []
        ids = [rank + k * p for k in range(v)]          # round-robin stages (v per rank)
        stages = [pp.PipelineStage(_Timed(whole[i * blocks:(i + 1) * blocks], spans, f"S{i}"),
                                   i, p * v, torch.device("cpu")) for i in ids]
        loss_fn = lambda out, target: F.mse_loss(out, target)  # noqa: E731
        sched = (getattr(pp, f"Schedule{name}")(stages if v > 1 else stages[0], micro_batches,
                                                loss_fn=loss_fn))
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(batch_size, width, generator=g), torch.randn(batch_size, width,
                                                                             generator=g)
        rec, times, busy, peaks = _SavedBytes(whole.parameters()), [], [], []
        for step in range(steps + 1):
            spans.clear()
            rec.live = rec.peak = 0
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                kw = {"target": target} if rank == p - 1 else {}
                sched.step(x, **kw) if rank == 0 else sched.step(**kw)
            dt = time.perf_counter() - t0
            if step:                                     # the first one builds buffers
                times.append(dt)
                busy.append(sum(s["end"] - s["start"] for s in spans))
                peaks.append(rec.peak)
        one = _SavedBytes(whole.parameters())            # one micro-batch through my stage(s)
        h = torch.randn(batch_size // micro_batches, width, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
            ys = [whole[i * blocks:(i + 1) * blocks](h) for i in ids]
            if rank == p - 1:                            # the last stage keeps the loss's too
                ys.append(loss_fn(ys[-1], torch.zeros_like(ys[-1])))
        del ys
        out[name] = dict(times=times, busy=busy, peak=max(peaks), per_mb=one.peak / v,
                         spans=[dict(s, rank=rank, lane="compute") for s in spans])
    return out


def measure_pipeline(world_size: int = 2, micro_batches: int = 4, schedules=SCHEDULES,
                     width: int = 256, blocks: int = 2, batch_size: int = 64, steps: int = 3,
                     progress: bool = True) -> dict:
    """Run each schedule on ``world_size`` ranks; measured bubble and peak activations vs formulas.

    Rows ``{schedule, step_ms, bubble (mean over ranks), bubble_formula, peak_mb (activations
    held at the peak, in micro-batches, per rank), memory_formula (per rank)}``; ``spans``: the
    last step's forward/backward spans per rank (for :func:`labkit.common.plots.timeline`).
    """
    bar = progress_bar(total=1, show=progress, desc=f"{len(schedules)} schedules", unit="job")
    res = run(_pipeline_rank, world_size, args=(tuple(schedules), micro_batches, width, blocks,
                                                batch_size, steps), deadline=JOB_DEADLINE, echo=False)
    bar.update(1)
    bar.close()
    p, m, rows, spans = world_size, micro_batches, [], {}
    for name in schedules:
        per_rank = [v[name] for v in res.values]
        step = slowest_runs([v["times"] for v in per_rank])
        bubbles = [1 - statistics.median(v["busy"]) / statistics.median(step) for v in per_rank]
        rows.append(dict(schedule=name, step_ms=statistics.median(step) * 1e3,
                         bubble=sum(bubbles) / p, bubble_per_rank=bubbles,
                         bubble_formula=bubble_formula(name, p, m),
                         peak_mb=[v["peak"] / v["per_mb"] for v in per_rank],
                         memory_formula=[memory_formula(name, p, m, r) for r in range(p)]))
        t0 = min(s["start"] for v in per_rank for s in v["spans"])
        spans[name] = [[dict(s, start=s["start"] - t0, end=s["end"] - t0) for s in v["spans"]]
                       for v in per_rank]
    return {"rows": rows, "spans": spans, "world_size": p, "micro_batches": m}


def pipeline_table(pipe: dict) -> str:
    p, m = pipe["world_size"], pipe["micro_batches"]
    return table([Col("schedule", "schedule", "<16"), Col("step ms", "step_ms", ">8.1f"),
                  Col("bubble", "bubble", ">7.2f"), Col("formula", "bubble_formula", ">8.2f"),
                  Col("peak per rank (measured)",
                      lambda r: " ".join(f"{x:.1f}" for x in r["peak_mb"]), "<26"),
                  Col("formula", "memory_formula")], pipe["rows"],
                 above=[f"{p} stages (ranks), {m} micro-batches; bubble = 1 - busy/step "
                        f"(measured, mean over ranks) vs the formula; activations held at the "
                        f"peak, in micro-batches"])
