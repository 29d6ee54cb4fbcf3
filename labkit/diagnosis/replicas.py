"""Evidence that ranks disagree when nothing fails: replica checksums, flight records, data shards.

The worst distributed bugs raise nothing: collectives issued in a different
order, a gradient that is never synchronised, BatchNorm statistics computed
per rank, a sampler that gives every rank the same data. Each leaves evidence
a rank can return and :func:`labkit.diagnosis.diagnose` can compare:

* :func:`fingerprint` - float64 checksums of every parameter and buffer. Data
  parallel replicas must agree on all of them after every optimizer step.
  :func:`check_replicas` compares them across ranks *inside* a job (an
  all_gather), so a training loop can stop at the first step that diverges.
* :func:`flight_record` - the process group's own log of the collectives a rank
  issued (PyTorch's flight recorder, on when ``TORCH_FR_BUFFER_SIZE`` > 0). The
  rank whose log stops early is the one that never called the collective.
* :class:`ShardLog` - the sample indices each rank saw in each epoch.

Example (inside a rank)::

    model = DDP(make_model())
    ...train...
    return lk.diagnosis.fingerprint(model)   # in the notebook: lk.diagnosis.diagnose(res)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .verdict import RankFinding, Verdict

__all__ = ["Fingerprint", "fingerprint", "check_replicas", "compare_fingerprints",
           "FlightRecord", "flight_record", "compare_flight_records", "ShardLog",
           "compare_shards", "diagnose_values"]


# ------------------------------------------------------------ replica checksums
@dataclass(frozen=True)
class Fingerprint:
    """Checksums of a replica: per named tensor (sum, sum of squares, position-weighted sum).

    Checksums, not hashes: equal fingerprints mean "the same to float64 precision
    as far as three sums can tell", which catches every divergence that matters here.
    """

    rank: int | None
    names: tuple[str, ...]
    kinds: tuple[str, ...]                     # "param" or "buffer", per name
    sums: tuple[tuple[float, float, float], ...]

    def __len__(self) -> int:
        return len(self.names)


def _sums(t) -> tuple[float, float, float]:
    import torch

    x = t.detach().reshape(-1).double()
    w = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)
    return (float(x.sum()), float((x * x).sum()), float((x * w).sum()))


def fingerprint(module) -> Fingerprint:
    """Checksums of every parameter and buffer of ``module`` (an ``nn.Module``, DDP-wrapped or not).

    >>> fp = lk.diagnosis.fingerprint(model)   # inside each rank; return it from the job
    """
    import torch.distributed as dist

    module = getattr(module, "module", module)  # DDP wraps the real model
    items = [(n, "param", p) for n, p in module.named_parameters()] + \
            [(n, "buffer", b) for n, b in module.named_buffers()]
    rank = dist.get_rank() if dist.is_initialized() else None
    return Fingerprint(rank, tuple(n for n, _, _ in items), tuple(k for _, k, _ in items),
                       tuple(_sums(t) for _, _, t in items))


def check_replicas(module, group=None, tolerance: float = 1e-9) -> Verdict:
    """Inside a job: compare this replica with every other rank's (an all_gather).

    Every rank gets the same verdict.

    Every rank must call it (it is a collective). Works with gloo and NCCL.

    >>> v = lk.diagnosis.check_replicas(model)
    >>> if not v.ok: raise RuntimeError(str(v))
    """
    import torch
    import torch.distributed as dist

    from ..common.ranks import uses_nccl
    fp = fingerprint(module)
    dev = (torch.device("cuda", torch.cuda.current_device())
           if uses_nccl(group) else torch.device("cpu"))
    n = dist.get_world_size(group)
    count = torch.tensor([len(fp)], dtype=torch.int64, device=dev)
    counts = [torch.zeros_like(count) for _ in range(n)]
    dist.all_gather(counts, count, group=group)  # same size on every rank: safe to gather
    if len({int(c) for c in counts}) > 1:
        return Verdict("replicas_diverged", "ranks hold models with different numbers of tensors: "
                       f"{[int(c) for c in counts]}", list(range(n)), cause="the ranks built "
                       "different models", fix="Build the same model on every rank.")
    mine = torch.tensor(fp.sums, dtype=torch.float64, device=dev).reshape(len(fp), 3)
    out = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    fps = [Fingerprint(r, fp.names, fp.kinds, tuple(tuple(map(float, row)) for row in o.cpu()))
           for r, o in enumerate(out)]
    return compare_fingerprints(fps, tolerance)


def _differs(a, b, tol: float) -> bool:
    return any(abs(x - y) > tol * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


def compare_fingerprints(fps: list[Fingerprint], tolerance: float = 1e-9,
                         findings: list[RankFinding] | None = None) -> Verdict:
    """A verdict on per-rank fingerprints: ``ok`` when all replicas agree."""
    ranks = [fp.rank if fp.rank is not None else i for i, fp in enumerate(fps)]
    ref = fps[0]
    if any(fp.names != ref.names for fp in fps):
        return Verdict("replicas_diverged", "the ranks hold differently named tensors", ranks,
                       cause="different models on different ranks", fix="Build the same model "
                       "everywhere.", ranks=findings or [])
    bad, culprits = [], set()
    for i, name in enumerate(ref.names):
        off = [r for r, fp in zip(ranks, fps) if _differs(fp.sums[i], ref.sums[i], tolerance)]
        if off:
            bad.append((name, ref.kinds[i], off, [fp.sums[i][0] for fp in fps]))
            culprits.update(off)
    n_p = ref.kinds.count("param")
    if not bad:
        return Verdict("ok", f"all {len(fps)} replicas agree on {n_p} parameters and "
                       f"{len(ref.names) - n_p} buffers", ranks=findings or [])
    kinds = {k for _, k, _, _ in bad}
    details = [f"{k} {name}: sums per rank " + ", ".join(f"{s:.6g}" for s in sums)
               for name, k, _, sums in bad[:6]] + ([f"... and {len(bad) - 6} more"]
                                                  if len(bad) > 6 else [])
    n_bp = sum(k == "param" for _, k, _, _ in bad)
    odd = sorted(culprits)
    n_b = len(ref.names) - n_p
    head = (f"{n_bp} of {n_p} parameters" + (f" and {len(bad) - n_bp} of {n_b} buffers"
                                            if n_b else "") +
            f" differ across ranks (rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} "
            f"differ{'s' * (len(odd) == 1)} from rank {ranks[0]})")
    if kinds == {"buffer"}:
        cause = ("only buffers differ: each rank updated them from its own batch (BatchNorm "
                 "running statistics). DDP averages gradients, not buffers, so weights agree but "
                 "statistics do not.")
        fix = ("All-reduce the batch statistics (SyncBatchNorm on GPUs; lk.pitfalls."
               "AllReduceBatchNorm1d on CPU), or broadcast rank 0's buffers before evaluating or "
               "saving.")
    else:
        cause = ("the replicas took different optimizer steps: a gradient that was not averaged "
                 "(no sync, or no_sync() on every micro-batch), collectives issued in a different "
                 "order on different ranks (same shapes: no error, wrong sums), or different "
                 "initial weights.")
        fix = ("Average every gradient across ranks before every optimizer step (DDP does it; by "
               "hand: all_reduce each grad in the same order on every rank, then divide by the "
               "world size), start from rank 0's weights, and check replicas periodically with "
               "lk.diagnosis.check_replicas(model).")
    return Verdict("replicas_diverged", head, sorted(culprits), cause=cause, fix=fix,
                   ranks=findings or [], details=details)


# ------------------------------------------------------------ flight recorder
@dataclass(frozen=True)
class FlightRecord:
    """One rank's flight-recorder log: (sequence number, collective, input sizes) per entry."""

    rank: int
    entries: tuple[tuple[int, str, tuple], ...]
    last_enqueued: int
    error: str | None = None   # what the rank caught while waiting, if anything

    def op(self, seq: int) -> str | None:
        return next((op for s, op, _ in self.entries if s == seq), None)


def flight_record(error: BaseException | str | None = None) -> FlightRecord:
    """Dump this rank's flight recorder (the default process group's entries).

    Needs ``TORCH_FR_BUFFER_SIZE`` > 0 in the rank's environment when the process
    group was created (``lk.run(..., env={"TORCH_FR_BUFFER_SIZE": "64"})``).
    gloo does not dump it on a timeout by itself: catch the error and call this.
    """
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace_json"):
        raise RuntimeError("this torch build has no flight recorder (_dump_fr_trace_json)")
    dump = json.loads(c10d._dump_fr_trace_json(True, True))
    entries = tuple((int(e["collective_seq_id"]), e["profiling_name"].split(":")[-1],
                     tuple(tuple(s) for s in e.get("input_sizes", [])))
                    for e in dump.get("entries", [])
                    if int(e.get("pg_id", 0)) == 0 and not e.get("is_p2p"))
    status = dump.get("pg_status", {}).get("0", {})
    last = int(status.get("last_enqueued_collective", max((s for s, _, _ in entries), default=0)))
    if error is not None and not isinstance(error, str):
        text = re.sub(r"\[/[^\]]*\] ", "", str(error).splitlines()[0])  # drop gloo's source path
        error = f"{type(error).__name__}: {text[:200]}"
    return FlightRecord(dist.get_rank(), entries, last, error)


def compare_flight_records(records: list[FlightRecord],
                           findings: list[RankFinding] | None = None) -> Verdict:
    """Which rank stopped early, and at which collective number (and which op)."""
    if not any(r.entries for r in records):
        return Verdict("hang", "the flight records are empty", [], cause="the flight recorder "
                       "was off", fix="Run with env={'TORCH_FR_BUFFER_SIZE': '64'}.",
                       ranks=findings or [])
    seqs = set.intersection(*({s for s, _, _ in r.entries} for r in records))
    for s in sorted(seqs):
        ops = {r.rank: r.op(s) for r in records}
        if len(set(ops.values())) > 1:
            desc = ", ".join(f"rank {k} {v}" for k, v in ops.items())
            return Verdict("mismatch", f"collective #{s} differs: {desc}", sorted(ops), " vs "
                           .join(sorted(set(ops.values()))), s, "the ranks issued different "
                           "collectives as their #%d." % s, "Call the same collectives in the "
                           "same order on every rank.", ranks=findings or [])
    top = max(r.last_enqueued for r in records)
    behind = sorted(r.rank for r in records if r.last_enqueued < top)
    if not behind:
        return Verdict("ok", f"every rank issued the same {top} collectives", ranks=findings or [])
    low = min(r.last_enqueued for r in records)
    ahead = next(r for r in records if r.last_enqueued == top)
    op = ahead.op(low + 1)
    last = next(r for r in records if r.rank == behind[0])
    details = [f"rank {r.rank}: last collective #{r.last_enqueued} "
               f"({r.op(r.last_enqueued) or '-'})" + (f"; caught {r.error}" if r.error else "")
               for r in records]
    return Verdict("missing_rank", f"rank{'s' * (len(behind) > 1)} "
                   f"{', '.join(map(str, behind))} stopped after collective #{low} "
                   f"({last.op(low) or '-'}); rank {ahead.rank} went on to #{low + 1} ({op}) and "
                   f"waited", behind, op, low + 1,
                   f"rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} never issued "
                   f"collective #{low + 1}: it was skipped there (an `if`, an early return) or the "
                   f"rank was stuck before it.",
                   "Call every collective on every rank in the same order; compare flight "
                   "records (or NCCL's automatic dumps) to find the first sequence number "
                   "where the ranks differ.", ranks=findings or [], details=details)


# ------------------------------------------------------------ data shards
@dataclass(frozen=True)
class ShardLog:
    """The dataset indices one rank saw, one tuple per epoch."""

    rank: int
    epochs: tuple[tuple[int, ...], ...]
    dataset_size: int


def compare_shards(logs: list[ShardLog], findings: list[RankFinding] | None = None) -> Verdict:
    """Overlap between ranks within an epoch, and repeated order across epochs."""
    details, culprits, cause, fix = [], set(), [], []
    n_epochs = min(len(lg.epochs) for lg in logs)
    for e in range(n_epochs):
        seen = [set(lg.epochs[e]) for lg in logs]
        dup = sum(len(a & b) for i, a in enumerate(seen) for b in seen[i + 1:])
        if dup:
            details.append(f"epoch {e}: {dup} samples seen by more than one rank, "
                           f"{len(set().union(*seen))} of {logs[0].dataset_size} covered")
            culprits.update(lg.rank for lg in logs)
    if details:
        cause.append("every rank iterates over the whole dataset (no DistributedSampler), so "
                     "each global batch holds copies of the same samples")
        fix.append("Use DataLoader(ds, sampler=DistributedSampler(ds)) so each rank gets a "
                   "disjoint 1/world_size of the data.")
    repeat = [lg.rank for lg in logs if n_epochs > 1 and
              all(lg.epochs[e] == lg.epochs[0] for e in range(1, n_epochs))
              and len(lg.epochs[0]) > 1]
    if repeat and not details:
        details.append(f"ranks {', '.join(map(str, repeat))} saw the same order in all "
                       f"{n_epochs} epochs")
        culprits.update(repeat)
        cause.append("DistributedSampler shuffles with seed + epoch, and the epoch was never "
                     "set, so every epoch repeats epoch 0's order")
        fix.append("Call sampler.set_epoch(epoch) at the start of every epoch.")
    if not details:
        return Verdict("ok", f"{len(logs)} ranks saw disjoint shards, shuffled anew each epoch",
                       ranks=findings or [])
    return Verdict("data_sharding", details[0], sorted(culprits), cause="; ".join(cause) + ".",
                   fix=" ".join(fix), ranks=findings or [], details=details[1:])


# ------------------------------------------------------------ dispatch
_TYPES = (Fingerprint, FlightRecord, ShardLog)


def _evidence(value):
    if isinstance(value, _TYPES):
        return value
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    return next((v for v in items if isinstance(v, _TYPES)), None)


def diagnose_values(values: list, findings: list[RankFinding] | None = None,
                    failed_job: bool = False) -> Verdict | None:
    """A verdict from what the ranks returned (fingerprints, flight records, shard logs).

    For a failed job, returns None unless the ranks returned flight records.
    """
    ev = [_evidence(v) for v in values]
    findings = [f for f in findings or [] if f.state != "ok"]  # "returned a record" says nothing
    kinds = {type(e) for e in ev if e is not None}
    if FlightRecord in kinds:  # the records say more than "rank r returned a record"
        return compare_flight_records([e for e in ev if isinstance(e, FlightRecord)], findings)
    if failed_job:
        return None
    if kinds == {Fingerprint} and all(e is not None for e in ev):
        return compare_fingerprints(ev, findings=findings)
    if kinds == {ShardLog} and all(e is not None for e in ev):
        return compare_shards(ev, findings)
    return Verdict("ok", f"all {len(values)} ranks returned normally", ranks=findings or [],
                   details=["Nothing failed. Silent errors show only when replicas are compared: "
                            "return lk.diagnosis.fingerprint(model) from every rank."])
