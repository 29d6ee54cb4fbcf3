"""Diagnosing a distributed job: which rank, which collective, where it is stuck, why, and the fix.

Notebook 04 teaches the order production engineers debug in, and
:func:`diagnose` follows it on a real :class:`~labkit.runtime.result.JobResult` (or the
:class:`~labkit.runtime.errors.JobFailed` that carries one):

1. **Find the first failure.** A crashed rank comes before the ranks that only
   saw its connection close ("echoes"); a rank whose own code raised comes
   before the ranks that timed out waiting for it.
2. **For a hang or a timeout, ask where every rank is.** A rank stuck in its
   own code, or one that returned normally, never reached the collective the
   others wait in; ranks waiting in *different* collectives are mismatched.
   The collective comes from each rank's traceback or live stack dump
   (:mod:`labkit.runtime.stacks`); the sequence number from ``TORCH_DISTRIBUTED_DEBUG=
   DETAIL`` messages or a flight record.
3. **When nothing failed, compare the replicas.** Silent errors (collectives in
   a different order, a missing gradient sync, BatchNorm statistics) only show
   as parameters or buffers that differ across ranks: return
   :func:`fingerprint` from every rank (or call :func:`check_replicas` inside
   the job); both live in :mod:`labkit.diagnosis.replicas`.

Example::

    res = lk.run(step, world_size=2, timeout=2, check=False)
    v = lk.diagnosis.diagnose(res)
    v.kind, v.culprits, v.collective     # ('missing_rank', [1], 'all_reduce')
    print(v)                              # headline, one line per rank, cause, fix
"""
from __future__ import annotations

import re

from ..runtime.errors import JobFailed
from .replicas import diagnose_values
from .findings import finding
from ..runtime.result import JobResult
from .verdict import RankFinding, Verdict

__all__ = ["diagnose"]

# ------------------------------------------------------------------ entry point
def diagnose(result_or_error) -> Verdict:
    """Turn a job (failed or not) into a :class:`Verdict`.

    Args:
        result_or_error: a :class:`JobResult` (``lk.run(..., check=False)``), a
            :class:`labkit.JobFailed` (its ``.result`` is used), or a list of
            per-rank evidence: fingerprints or flight records (see :mod:`labkit.diagnosis.replicas`).

    >>> try:
    ...     lk.run(step, world_size=2, timeout=2)
    ... except lk.JobFailed as err:
    ...     print(lk.diagnosis.diagnose(err))
    """
    if isinstance(result_or_error, JobFailed):
        result_or_error = result_or_error.result
    if isinstance(result_or_error, (list, tuple)):
        return diagnose_values(list(result_or_error))
    if not isinstance(result_or_error, JobResult):
        raise TypeError(f"diagnose() takes the JobResult of lk.run(..., check=False) or the "
                        f"lk.JobFailed it raised, not {type(result_or_error).__name__}.")
    res = result_or_error
    findings = [finding(r) for r in res.ranks]
    if res.ok:
        return diagnose_values(res.values, findings)
    evidence = diagnose_values(res.values, findings, failed_job=True)
    if evidence is not None:  # flight records returned by ranks that caught their timeout
        return evidence
    return _diagnose_failure(res, findings)


# ---------------------------------------------------------------- the job
_FP = re.compile(r"Rank (\d+) is running collective: "
                 r"CollectiveFingerPrint\(SequenceNumber=(\d+),?\s*OpType=(\w+)"
                 r"(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?")
_OPS = {"ALLREDUCE": "all_reduce", "BROADCAST": "broadcast", "BARRIER": "barrier",
        "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
        "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
        "REDUCE": "reduce", "GATHER": "gather", "SCATTER": "scatter", "ALLTOALL": "all_to_all",
        "ALLTOALL_BASE": "all_to_all_single", "SEND": "send", "RECV": "recv"}
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), "
                       r"OpType=(\w+)")
_MONITORED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")
_UNUSED_IDX = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]+)")
_SAME_ORDER = ("Call every collective on every rank, unconditionally and in the same order "
               "(no collective under `if rank == ...`, no early return, no per-rank loop "
               "counts). Debug with TORCH_DISTRIBUTED_DEBUG=DETAIL (names mismatched "
               "collectives at once) and dist.monitored_barrier(wait_all_ranks=True) "
               "(names missing ranks).")


def _diagnose_failure(res: JobResult, findings: list[RankFinding]) -> Verdict:
    by = {s: [f for f in findings if f.state == s] for s in
          ("ok", "raised", "crashed", "hung", "timed out", "echo")}
    rr = {r.rank: r for r in res.ranks}
    if by["crashed"]:
        return _crash(res, findings, by["crashed"], rr)
    for f in by["raised"] + by["echo"]:
        err = rr[f.rank].error or ""
        if "Detected mismatch between collectives" in err:
            return _detail_mismatch(res, findings)
        m = _MONITORED.search(err)
        if m:
            missing = [int(x) for x in m[1].replace(" ", "").split(",") if x]
            return Verdict("missing_rank", f"rank{'s' * (len(missing) > 1)} "
                           f"{_join(missing)} never reached monitored_barrier (waited {m[2]} ms)",
                           missing, "monitored_barrier", None,
                           f"rank{'s' * (len(missing) > 1)} {_join(missing)} did not arrive in "
                           f"time: still busy elsewhere, stuck, or skipped the barrier.",
                           "Look at what those ranks were doing (their stacks below). "
                           + _SAME_ORDER, findings)
    if by["raised"]:
        return _raised(by["raised"], findings, rr)
    # An echo inside a collective was waiting there too, until a timed-out peer left.
    waiting = by["timed out"] + [f for f in by["hung"] + by["echo"] if f.collective]
    elsewhere = [f for f in by["hung"] if not f.collective] + by["ok"]
    if waiting and elsewhere:
        return _missing(waiting, elsewhere, findings)
    ops = {f.collective for f in waiting}
    if len(ops) > 1:
        desc = ", ".join(f"rank {f.rank} in {f.collective}"
                         for f in sorted(waiting, key=lambda f: f.rank))
        return Verdict("mismatch", f"ranks wait in different collectives: {desc}",
                       sorted(f.rank for f in waiting), " vs ".join(sorted(ops)), None,
                       "the ranks called different collectives at the same point of the program "
                       "(e.g. all_reduce on one rank, broadcast or barrier on another; a "
                       "collective under `if rank == 0:`); each waits for partners that never "
                       "come.",
                       _SAME_ORDER, findings)
    if by["echo"] and not by["timed out"] and not any(f.collective for f in by["hung"]):
        return Verdict("crash", "every failing rank only saw a peer's connection close",
                       [], None, None, "a rank went away without a report (killed from outside?)",
                       "Look for a rank killed by the OOM killer or a signal; run again.", findings)
    op = next(iter(ops), None)
    return Verdict("hang", f"all ranks were stuck{f' in {op}' if op else ''} with no culprit found",
                   [], op, None, "every rank waited; perhaps a rank of another job, a deadlock "
                   "inside one collective, or work slower than the timeout.",
                   "If the work is only slow, raise timeout=. Otherwise compare the ranks' stacks "
                   "and rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL.", findings)


def _first_collective(waiting: list[RankFinding]) -> str | None:
    """The earliest collective the waiting ranks are in (program order, when one file holds them).

    Ranks can be in different collectives: a broadcast's non-root ranks need only the
    root, so they pass it without the missing rank and wait in the next collective.
    """
    if len({f.at[0] for f in waiting if f.at}) == 1 and all(f.at for f in waiting):
        return min(waiting, key=lambda f: f.at[1]).collective
    return next((f.collective for f in waiting if f.collective), None)


def _missing(waiting, elsewhere, findings) -> Verdict:
    culprits = sorted(f.rank for f in elsewhere)
    op = _first_collective(waiting)
    returned = [f for f in elsewhere if f.state == "ok"]
    busy = [f for f in elsewhere if f.state == "hung"]
    why = []
    if returned:
        why.append(f"rank{'s' * (len(returned) > 1)} {_join(f.rank for f in returned)} returned "
                   f"normally without calling it (the collective was skipped, under an `if`, or "
                   f"the rank ran out of data first: uneven inputs)")
    if busy:
        why.append(f"rank{'s' * (len(busy) > 1)} {_join(f.rank for f in busy)} "
                   f"{'were' if len(busy) > 1 else 'was'} still in "
                   f"{'; '.join(f.where or '?' for f in busy)}, outside any collective (late, or "
                   f"stuck in its own code)")
    fix = _SAME_ORDER
    if op and op.startswith("backward"):
        fix = ("Ranks ran different numbers of training steps (uneven inputs): give every rank "
               "the same number of batches (DistributedSampler(drop_last=True)) or wrap the loop "
               "in `with torch.distributed.algorithms.join.Join([model]):`.")
    elif busy and not returned:
        fix = ("Find out why the late rank is slow or stuck (its line above). If the work is just "
               "slow, raise the timeout; " + _SAME_ORDER[0].lower() + _SAME_ORDER[1:])
    ops = {f.collective for f in waiting}
    waits = (f"{_ranks(f.rank for f in waiting).lower()} waited in it" if len(ops) == 1 else
             "the others waited: " + "; ".join(
                 f"{_ranks(f.rank for f in waiting if f.collective == o).lower()} in {o}"
                 for o in sorted(ops, key=lambda o: [f.collective for f in waiting].index(o))))
    details = ([f"Ranks waiting in a later collective got past {op} without the missing rank "
                f"(e.g. a broadcast's non-root ranks need only the root): the earliest "
                f"collective is the one that was missed."] if len(ops) > 1 else [])
    return Verdict("missing_rank", f"{_ranks(culprits).lower()} never reached "
                   f"{op or 'the collective'}; {waits}", culprits, op, None,
                   "; ".join(why) + ".", fix, findings, details)


def _detail_mismatch(res: JobResult, findings) -> Verdict:
    # Each rank's message starts with its own fingerprint (reliable); what it says about the
    # other rank was received through the same broken sequence and can be garbled.
    fps = {}
    for r in res.ranks:
        for rk, s, op, shape, dt in _FP.findall(r.error or ""):
            if int(rk) == r.rank or int(rk) not in fps:
                fps[int(rk)] = (int(rk), int(s), _OPS.get(op, op.lower()), shape, dt)
    fps = [fps[k] for k in sorted(fps)]
    ranks = sorted({fp[0] for fp in fps})
    seq = fps[0][1] if fps else None
    ops = sorted({fp[2] for fp in fps})
    sizes = {(fp[3], fp[4]) for fp in fps}
    desc = ", ".join(f"rank {r} {op}" + (f" of shape [{sh}] {dt}" if dt else "")
                     for r, _, op, sh, dt in fps)
    if len(ops) == 1 and len(sizes) > 1:
        return Verdict("size_mismatch", f"collective #{seq}: {desc}", ranks, ops[0], seq,
                       "the ranks passed tensors of different shapes or dtypes to the same "
                       "collective (DETAIL caught it before gloo aborted).",
                       "Give every rank the same shape and dtype (pad, or all_gather the sizes "
                       "first).", findings)
    return Verdict("mismatch", f"collective #{seq} differs: {desc}", ranks, " vs ".join(ops), seq,
                   "the ranks reached different collectives at the same sequence number "
                   "(TORCH_DISTRIBUTED_DEBUG=DETAIL compared their fingerprints).",
                   _SAME_ORDER, findings)


def _crash(res, findings, crashed, rr) -> Verdict:
    first = res.first_failure()
    culprit = next((f for f in crashed if f.rank == first.rank), crashed[0])
    r = rr[culprit.rank]
    echoes = [f.rank for f in findings if f.state == "echo"]
    after = f" {_ranks(echoes)} only saw the connection drop (echoes)." if echoes else ""
    if "Received data size doesn't match expected size" in r.stderr or "EnforceNotMet" in r.stderr:
        return Verdict("size_mismatch", f"rank {r.rank} aborted ({r.signal or r.exitcode}) inside "
                       f"{culprit.collective or 'a collective'}: gloo received a different size",
                       [r.rank], culprit.collective, None,
                       "the ranks passed tensors of different element counts or dtypes to the same "
                       "collective; gloo aborts the process (SIGABRT, no Python exception to "
                       "catch)." + after,
                       "Give every rank the same shape and dtype (pad, or all_gather the sizes "
                       "first). TORCH_DISTRIBUTED_DEBUG=DETAIL turns this into a Python error "
                       "naming both shapes.", findings)
    m = _WATCHDOG.search(r.stderr or "")
    if m:  # NCCL: the watchdog thread noticed the timeout and tore the process down
        seq, op = int(m[1]), _OPS.get(m[2], m[2].lower())
        late = [f.rank for f in findings if f.state == "ok" or (f.state == "hung"
                                                                and not f.collective)]
        return Verdict("missing_rank" if late else "hang",
                       f"NCCL watchdog on rank {r.rank}: {op} #{seq} timed out"
                       + (f"; {_ranks(late).lower()} never joined it" if late else ""),
                       late, op, seq,
                       f"rank {r.rank} waited in {op} (#{seq}) past the process-group timeout; "
                       f"NCCL's watchdog thread noticed and tore the process down "
                       f"(TORCH_NCCL_ASYNC_ERROR_HANDLING)." + after,
                       _SAME_ORDER + " On NCCL also set TORCH_FR_BUFFER_SIZE and "
                       "TORCH_NCCL_DUMP_ON_TIMEOUT=1 to get each rank's flight record.", findings)
    if r.signal == "SIGSEGV" and "_ddp_init_helper" in r.stderr:
        cause = ("DDP construction crashed in native code; with TORCH_DISTRIBUTED_DEBUG=DETAIL on "
                 "gloo this is a known torch 2.13.0 crash.")
        fix = "Use TORCH_DISTRIBUTED_DEBUG=INFO with DDP, and DETAIL only with raw collectives."
    else:
        cause = f"rank {r.rank} {culprit.detail}."
        fix = ("Read that rank's stderr and traceback (err.result[r]); find why it died (an "
               "exception, os._exit, the out-of-memory killer, a native crash).")
    return Verdict("crash", f"rank {r.rank} died ({culprit.detail})", [r.rank],
                   culprit.collective, None, cause + after, fix, findings)


def _raised(raised, findings, rr) -> Verdict:
    f = raised[0]
    err = rr[f.rank].error or ""
    names = [r.rank for r in raised]
    if "Expected to have finished reduction in the prior iteration" in err:
        m, n = _UNUSED_IDX.search(err), _UNUSED_NAMES.search(err)
        which = (n[1].strip() if n else "") or (f"with indices {m[1].strip()}" if m else "")
        return Verdict("unused_parameters", f"DDP raised on rank{'s' * (len(names) > 1)} "
                       f"{_join(names)} at {f.where}: parameters {which} got no gradient",
                       names, None, None,
                       "some parameters took no part in the loss, so DDP's reducer never finished "
                       "the previous iteration; it notices at the start of the next one "
                       "(iteration 2).",
                       "Pass find_unused_parameters=True to DistributedDataParallel (it then "
                       "searches the graph every step), or remove the unused parameters. "
                       "TORCH_DISTRIBUTED_DEBUG=INFO names them.", findings)
    fix = ("Fix the exception in that rank's code (its traceback is err.__cause__ / "
           "res[r].traceback).")
    if "SyncBatchNorm layers only work with GPU modules" in err:
        fix = ("SyncBatchNorm needs CUDA. On CPU, all-reduce the batch statistics yourself "
               "(lk.pitfalls.AllReduceBatchNorm1d) or keep plain BatchNorm and accept per-rank "
               "running statistics.")
    echoes = [x.rank for x in findings if x.state in ("echo", "timed out")]
    return Verdict("error", f"rank{'s' * (len(names) > 1)} {_join(names)} raised "
                   f"{f.detail.split(':')[0]} at {f.where}", names, f.collective, None,
                   f"{f.detail}." + (f" {_ranks(echoes)} failed only because of it." if echoes
                                     else ""), fix, findings)


def _join(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"Rank{'s' * (len(ranks) > 1)} {_join(ranks)}"
