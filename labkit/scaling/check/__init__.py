"""Notebook 07's exercise checker (a compression hook written by hand) and its quiz keys.

**The exercise.** The learner writes ``fp16_hook(state, bucket)``, a DDP communication hook
that sends the bucket's gradients as float16 and leaves every rank with their fp32 average.
:func:`check_compress_hook` registers it on a DDP model in real ranks (2 and 3) next to a
reference DDP model with the default all-reduce, same initial weights, and a plain copy that
gives each rank's local gradient; every rank draws its data from a secret of its own. Every
step, on every rank, it checks:

* **the gradient** — within float16's stated error of the averaged fp32 gradient: casting
  to fp16 and adding n numbers in fp16 errs by at most about n·2^-11 of the largest local
  gradient (plus 1e-6 for values fp16 flushes to 0);
* **the bytes** — what the rank all-reduced during the hooked backward, **counted** by
  ``lk.run(trace=True)`` (every collective that reaches PyTorch's dispatcher from the hook's
  thread, any thread started while the job runs, or a future's callback: see
  :mod:`labkit.runtime.commtrace` for exactly what it sees), must be at most half of the fp32
  buckets' bytes, and more than 0;
* **float16 values** — every element of every averaged gradient survives a round trip through
  ``torch.float16`` unchanged: the exercise sums fp16 shares, so its result is an fp16 number;
  an fp32 average (an fp32 all-reduce, or gradients shared through the process group's store or
  a file) almost never is. The data come from ``os.urandom`` inside the ranks at every grading,
  so no precomputed answer meets it;
* **the route** — a recorder with ``keep_tensors=True`` copies what each all-reduce of the
  hooked backward sent (before it ran) and received (when it finished), in every thread: the
  float16 all-reduces must have carried this rank's share of every bucket (its local gradients
  cast to fp16 and divided by the world size, within fp16's rounding) and the gradients DDP got
  must be exactly what they produced. So a result kept from an earlier call, computed from the
  checker's own data, or brought by any channel the trace cannot see (the store, a file, a
  socket, a backend object called directly) fails, whatever else the hook also sends;
* **the replicas** — every rank ends with the same parameters (compared with all_gather);
* **training** — after a few steps the held-out loss is below where it started and within 10%
  of the reference run's;
* **by hand** — nothing in ``torch.distributed.algorithms.ddp_comm_hooks`` ran inside the
  hook (``sys.setprofile`` watches every call it makes).

So: no compression fails the bytes, the fp16 values and the route; wrong averaging (summed, or
divided twice) the gradient and the route; doing nothing the gradient, the bytes and the
replicas; a side channel (a helper thread's fp32 all-reduce, the store, a file), hidden state
or the checker's own data the route (each message says what was recorded); and calling torch's
``fp16_compress_hook`` every case, the last one naming it (``tests/scaling/test_scaling_check.py``
feeds each). A check that cannot run fails its case and says why.

**Quiz keys** (``key = "labkit.scaling.check:..."``) compute answers from the learner's own
measurements: the notebook's ``scaling``, ``hooks`` and ``knobs``.
"""
from __future__ import annotations

import sys
from typing import Callable

from ...grading.exercise import Case, NotDone
from ...runtime import run

__all__ = ["check_compress_hook", "hook_job", "probe_job", "weak_speedup_2", "strong_efficiency_4", "weak_comm_share_2",
           "strong_efficiency_4_from_weak",
           "fp16_bytes_per_step", "view_bytes_saved", "unused_allreduces",
           "FP16_EPS"]

FP16_EPS = 2.0 ** -11            # float16's unit roundoff (10 stored mantissa bits)
_LIBRARY = "ddp_comm_hooks"      # torch/distributed/algorithms/ddp_comm_hooks/*.py
_STEPS = 8


# ------------------------------------------------------------------ inside the ranks
def _watched(fn, state: dict):
    """Wrap the learner's hook: note calls into torch's hook library and a stub, and each
    bucket's local gradients and parameters (what its all-reduce must carry and fill)."""
    def hook(process_state, bucket):
        def profile(frame, event, arg):
            if event == "call" and _LIBRARY in frame.f_code.co_filename:
                state["library"] = frame.f_code.co_name
        state["calls"] += 1
        state["buckets"].append((bucket.buffer().detach().clone(), list(bucket.parameters())))
        old = sys.getprofile()
        sys.setprofile(profile)
        try:
            return fn(process_state, bucket)
        except NotImplementedError:
            state["not_done"] = True
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            return allreduce_hook(process_state, bucket)   # finish the step, then stop
        finally:
            sys.setprofile(old)
    return hook


def hook_job(rank: int, world_size: int, fn: Callable, steps: int = _STEPS) -> dict:
    """Train a hooked DDP model next to a reference one; report what the checker needs."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...runtime import commtrace
    from ..task import IN_DIM, eval_loss, label, student
    secret = int.from_bytes(os.urandom(4), "little")        # this rank's data: its own secret
    data = torch.Generator().manual_seed(secret)
    mine_m, oracle_m, base_m, plain = (student(48, 3, seed=1) for _ in range(4))
    mine, oracle, base = (DDP(m, bucket_cap_mb=0.004) for m in (mine_m, oracle_m, base_m))
    state = {"calls": 0, "library": "", "not_done": False, "buckets": []}
    mine.register_comm_hook(None, _watched(fn, state))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (mine_m, base_m)]
    start_loss = eval_loss(mine_m)
    worst, bucket_bytes, routes, not_fp16 = [], [], [], []
    for step in range(steps):
        x = torch.randn(16, IN_DIM, generator=data)
        y = label(x)
        for m in (oracle_m, plain):                         # the reference, at mine's weights
            m.load_state_dict(mine_m.state_dict())
        for m in (mine, oracle, base, plain):
            m.zero_grad()
        F.mse_loss(plain(x), y).backward()                  # this rank's local gradient
        loss = F.mse_loss(mine(x), y)        # forward: DDP's own bookkeeping, not the hook's
        state["buckets"].clear()
        with commtrace.CommRecorder(keep_tensors=True) as tap, commtrace.label(f"mine {step}"):
            loss.backward()
        if state["not_done"]:
            return {"not_done": True}
        routes.append(_route(tap.records, state["buckets"], world_size))
        not_fp16.append(_not_fp16(mine_m))
        F.mse_loss(oracle(x), y).backward()                 # the fp32 average, by DDP
        F.mse_loss(base(x), y).backward()                   # an uncompressed run, trained
        local_max = torch.stack([p.grad.abs().max() for p in plain.parameters()])
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX)    # the largest local gradient
        errs = []
        for (name, p), q, m in zip(mine_m.named_parameters(), oracle_m.parameters(), local_max):
            tol = 2 * world_size * FP16_EPS * float(m) + 1e-6
            errs.append((float((p.grad - q.grad).abs().max()) / tol, name))
        worst.append(max(errs))
        bucket_bytes.append(sum(p.numel() * 4 for p in mine_m.parameters()))
        for opt in opts:
            opt.step()
    mine_sum = torch.tensor([float(sum(p.double().sum() for p in mine_m.parameters()))],
                            dtype=torch.float64)
    sums = [torch.zeros_like(mine_sum) for _ in range(world_size)]
    dist.all_gather(sums, mine_sum)
    return {"not_done": False, "worst": worst, "bucket_bytes": bucket_bytes, "routes": routes,
            "not_fp16": not_fp16,
            "library": state["library"], "calls": state["calls"],
            "sums": [float(s) for s in sums], "start": start_loss,
            "mine_loss": eval_loss(mine_m), "ref_loss": eval_loss(base_m)}


def _route(records: list, buckets: list, n: int) -> str:
    """"" when the hooked backward's float16 all-reduces carried each rank's share of every
    bucket (its local gradients cast to fp16 and divided by ``n``) and the gradients DDP got
    are exactly what they produced; else what went otherwise. ``records``: a keep_tensors
    recorder's, from every thread; ``buckets``: ``(local gradients, parameters)`` per call."""
    import torch

    if not buckets:
        return "DDP never called the hook during backward"
    ops = [r for r in records if r["kind"] == "all_reduce" and r["dtype"] == "torch.float16"]
    local = torch.cat([g.flatten() for g, _ in buckets])
    got = torch.cat([p.grad.flatten() for _, params in buckets for p in params])
    sent = torch.cat([t.flatten().float() for r in ops for t in r["sent"]] or [torch.zeros(0)])
    if sent.numel() != local.numel():
        return (f"its float16 all-reduces carried {sent.numel()} values for {local.numel()} "
                f"gradients (recorded during backward: {_summary(records)}): a rank must send "
                f"its gradients as float16, through that all-reduce; anything else (float32 "
                f"on the wire, another thread, the process group's store, a file, data taken "
                f"from the checker) does not count")
    share = local / n
    off = (sent - share).abs() > 2 * FP16_EPS * share.abs() + 2.0 ** -24
    if off.any():
        i = int(off.nonzero()[0])
        return (f"its float16 all-reduce carried {float(sent[i]):.6g} where this rank's share is "
                f"{float(share[i]):.6g} (its gradient {float(local[i]):.6g} cast to float16 and "
                f"divided by the world size, {n})")
    received = [t.flatten().float() for r in ops for t in (r["received"] or [None])]
    if any(t is None for t in received):
        return "a float16 all-reduce never finished"
    received = torch.cat(received)
    if not torch.equal(received, got):
        i = int((received != got).nonzero()[0])
        return (f"the gradients it handed back are not what its float16 all-reduce produced "
                f"({float(got[i]):.6g} where the all-reduce gave {float(received[i]):.6g}): a "
                f"result kept from an earlier call, or one that came another way (another "
                f"thread, the process group's store, a file)")
    return ""


def _summary(records: list) -> str:
    """What collectives a block recorded: kind, dtype, bytes and the issuing thread."""
    if not records:
        return "no collective at all"
    parts = [f"{r['kind']} {r['dtype'].replace('torch.', '')} {r['bytes']} B from "
             f"{r['thread']!r}" for r in records[:4]]
    return ", ".join(parts) + (f" and {len(records) - 4} more" if len(records) > 4 else "")


def _not_fp16(model) -> str:
    """"" when every gradient survives a round trip through float16; else the first that does
    not (what a sum computed in float16 always does)."""
    import torch

    for name, p in model.named_parameters():
        back = p.grad.to(torch.float16).float()
        if not torch.equal(back, p.grad):
            i = int((back != p.grad).flatten().nonzero()[0])
            return (f"{name}.grad holds {float(p.grad.flatten()[i])!r}, which float16 cannot "
                    f"hold ({int((back != p.grad).sum())} of its {p.numel()} elements)")
    return ""


class _Bucket:
    """Stands in for DDP's GradBucket in :func:`probe_job` (what a hook may call on it)."""

    def __init__(self, buffer) -> None:
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self):
        return [self._buffer]

    def parameters(self):
        return []


def probe_job(rank: int, world_size: int, fn: Callable) -> str:
    """Call the hook once on a plain tensor, without DDP: a stub or a hook that returns no
    Future is named in a second, before DDP's start-up cost is paid."""
    import torch

    try:
        fut = fn(None, _Bucket(torch.ones(8) * (rank + 1)))
    except NotImplementedError:
        return "not done"
    if not hasattr(fut, "wait") or not hasattr(fut, "then"):
        return (f"the hook returned {type(fut).__name__}, not a torch.futures.Future (return "
                f"fut.then(decompress))")
    fut.wait()
    return "ok"


# ------------------------------------------------------------------ the checker
def check_compress_hook(fn: Callable, world_sizes: tuple = (2, 3), timeout: float = 30.0) -> list:
    """Check the learner's fp16 compression hook on real ranks: ``list[Case]``.

    Example::

        lk.exercise.check("07.fp16_hook", fp16_hook)      # calls this
    """
    cases: list[Case] = []
    library = ""
    probe = run(probe_job, world_sizes[0], args=(fn,), timeout=timeout, deadline=timeout + 30,
                check=False, echo=False)
    if probe.ok and "not done" in probe.values:
        raise NotDone("the hook raises NotImplementedError")
    if probe.ok and any(v != "ok" for v in probe.values):
        why = next(v for v in probe.values if v != "ok")
        return [Case("returns a Future of the averaged bucket", False, why)]
    for n in world_sizes:
        names = [f"{n} ranks: gradients equal the fp32 average within fp16's error",
                 f"{n} ranks: at most half the fp32 bytes sent (counted by the trace)",
                 f"{n} ranks: every averaged gradient is a float16 value",
                 f"{n} ranks: the gradients are what the fp16 all-reduce of the shares gave",
                 f"{n} ranks: replicas stay identical",
                 f"{n} ranks: the model still trains"]
        res = run(hook_job, n, args=(fn,), trace=True, timeout=timeout, deadline=timeout + 30,
                  check=False, echo=False)
        if not res.ok:
            why = _failure(res)
            cases += [Case(name, False, f"the job failed: {why}") for name in names]
            continue
        reports = res.values
        if any(r["not_done"] for r in reports):
            raise NotDone(f"{n} ranks")
        library = library or next((r["library"] for r in reports if r["library"]), "")
        verdicts = [_gradients(reports), _bytes(res.trace, reports, n),
                    _per_step(reports, "not_fp16", "every gradient survives a round trip "
                              "through float16", "it was not summed in float16 (float32 on the "
                              "wire, another thread, the process group's store, a file)"),
                    _per_step(reports, "routes", "every bucket, through the all-reduce", ""),
                    _replicas(reports), _trains(reports[0])]
        cases += [Case(name, ok, detail) for name, (ok, detail) in zip(names, verdicts)]
    cases.append(Case("written by hand (not torch's fp16_compress_hook)", not library,
                      f"your hook called torch's {library}() from ddp_comm_hooks: write the "
                      f"cast, the all-reduce and the decompression yourself" if library else
                      "no call into torch.distributed.algorithms.ddp_comm_hooks"))
    if library:     # torch's hook did the work: no case of it is the learner's
        cases = [Case(c.name, False, c.detail if not c.passed else
                      f"not counted: torch's {library}() did the work (see the last case)")
                 for c in cases]
    return cases


def _failure(res) -> str:
    r = res.first_failure()
    return r.describe() if r is not None else "unknown"


def _gradients(reports) -> tuple[bool, str]:
    for rank, r in enumerate(reports):
        for step, (ratio, name) in enumerate(r["worst"]):
            if ratio > 1.0:
                return False, (f"rank {rank}, step {step}: {name}.grad is off the averaged fp32 "
                               f"gradient by {ratio:.3g}x fp16's error bound (did you average "
                               f"— divide by the world size once — and all-reduce every bucket?)")
    worst = max(ratio for r in reports for ratio, _ in r["worst"])
    return True, f"worst error {worst:.2f} of the bound, every rank, every step"


def _bytes(trace, reports, n) -> tuple[bool, str]:
    for rank, r in enumerate(reports):
        for step, fp32 in enumerate(r["bucket_bytes"]):
            sent = trace.bytes(rank=rank, label=f"mine {step}")
            if sent == 0:
                return False, (f"rank {rank}, step {step}: no collective during backward, so "
                               f"no rank can know the others' gradients")
            if sent > fp32 / 2:
                what = _summary(trace.select(rank=rank, label=f"mine {step}"))
                return False, (f"rank {rank}, step {step}: all-reduced {sent} bytes, more than "
                               f"half of the fp32 gradients' {fp32} (compress before sending; "
                               f"recorded: {what})")
    sent = trace.bytes(rank=0, label=f"mine {_STEPS - 1}")
    return True, f"{sent} bytes per step of {reports[0]['bucket_bytes'][-1]} in fp32"


def _per_step(reports, key: str, good: str, why: str) -> tuple[bool, str]:
    """The first rank and step whose ``key`` report names a fault (``why`` appended), or ok."""
    for rank, r in enumerate(reports):
        for step, fault in enumerate(r[key]):
            if fault:
                return False, f"rank {rank}, step {step}: {fault}" + (f": {why}" if why else "")
    return True, good + ", every rank, every step"


def _replicas(reports) -> tuple[bool, str]:
    sums = reports[0]["sums"]
    if len(set(sums)) != 1:
        return False, f"parameter checksums differ across ranks after training: {sums}"
    return True, "same parameters on every rank"


def _trains(r) -> tuple[bool, str]:
    ok = r["mine_loss"] < r["start"] and r["mine_loss"] <= 1.1 * r["ref_loss"] + 1e-4
    detail = (f"held-out loss {r['start']:.4f} -> {r['mine_loss']:.4f} (uncompressed "
              f"{r['ref_loss']:.4f})")
    return ok, detail if ok else detail + ": it must fall, to within 10% of the uncompressed run"


# ------------------------------------------------------------------ quiz keys
def _row(table: dict, **match) -> dict:
    if not isinstance(table, dict) or "rows" not in table:
        raise ValueError("pass the notebook's measurement (run its cell first)")
    for r in table["rows"]:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise ValueError(f"no row {match} in this measurement")


def weak_speedup_2(scaling: dict) -> float:
    """07.weak_speedup_2: the measured median weak-scaling speedup on 2 ranks."""
    return _row(scaling, mode="weak", ranks=2)["speedup"]["median"]


def strong_efficiency_4(scaling: dict) -> float:
    """07.strong_efficiency_4: the measured median strong-scaling efficiency on 4 ranks."""
    return _row(scaling, mode="strong", ranks=4)["efficiency"]["median"]


def weak_comm_share_2(scaling: dict) -> float:
    """07.weak_speedup_2: the share of the 2-rank 'alone' throughput weak scaling lost,
    1 - samples/s(weak, 2) / samples/s(alone, 2), from the medians."""
    weak = _row(scaling, mode="weak", ranks=2)["samples_per_s"]["median"]
    return 1 - weak / _row(scaling, mode="alone", ranks=2)["samples_per_s"]["median"]


def strong_efficiency_4_from_weak(scaling: dict) -> float:
    """07.strong_efficiency_4: the strong-scaling efficiency on 4 ranks that the weak row
    predicts (the same per-rank job at 4 ranks): samples/s(weak, 4) / samples/s(strong, 1) / 4."""
    weak4 = _row(scaling, mode="weak", ranks=4)["samples_per_s"]["median"]
    return weak4 / _row(scaling, mode="strong", ranks=1)["samples_per_s"]["median"] / 4


def fp16_bytes_per_step(hooks: dict) -> float:
    """07.fp16_bytes: bytes per step rank 0 all-reduced with fp16_compress_hook (counted)."""
    return float(_row(hooks, hook="fp16")["bytes_per_step"])


def view_bytes_saved(knobs: dict) -> float:
    """07.view_saving: bytes per parameter gradient_as_bucket_view=True saved (measured)."""
    mem = knobs["memory"]
    return mem[False]["bytes_per_param"] - mem[True]["bytes_per_param"]


def unused_allreduces(knobs: dict) -> float:
    """07.unused_allreduces: all-reduces per step with find_unused_parameters=True (counted)."""
    return float(_row(knobs, setting="find_unused_parameters=True")["allreduces"])
