"""Checking an all-reduce against ``dist.all_reduce``, case by case (the notebook 03 exercise).

The cases are the tensors a hand-written all-reduce gets wrong: a length that the world
size does not divide, fewer elements than ranks, one element, none, float64 and int64,
several dimensions, a non-contiguous view. Each case runs on real ranks; the reference is
``dist.all_reduce`` on the same inputs. Integer-valued inputs make the expected sums exact
whatever order a ring adds them in; ``"random floats"`` is compared with a tolerance.
Exposed as ``lk.collectives.CASES`` and ``lk.collectives.check_ring_exercise``. The quiz
keys of notebook 03 (computed from the learner's own traced runs) are here too.
"""
from __future__ import annotations

import json
import re
import zlib
from typing import Any, Callable

from ..grading.exercise import Case, NotDone
from ..runtime import run
from .trace import Trace, tracing

__all__ = ["CASES", "case_tensor", "compare_job", "check_ring_exercise", "rank2_step3_bytes",
           "master_bytes_received"]

# name -> (shape as a function of the world size n, dtype, view)
CASES: dict[str, tuple[Callable[[int], tuple], str, str]] = {
    "divisible": (lambda n: (4 * n,), "float32", ""),
    "not divisible": (lambda n: (4 * n + 1,), "float32", ""),
    "fewer elements than ranks": (lambda n: (max(n - 1, 1),), "float32", ""),
    "single element": (lambda n: (1,), "float32", ""),
    "empty": (lambda n: (0,), "float32", ""),
    "float64, 2-D": (lambda n: (3, 5), "float64", ""),
    "int64": (lambda n: (2 * n + 3,), "int64", ""),
    "3-D": (lambda n: (2, 3, 4), "float32", ""),
    "non-contiguous": (lambda n: (5, 3), "float32", "transpose"),
    "random floats": (lambda n: (1000,), "float32", "random"),
}


def case_tensor(name: str, rank: int, world_size: int, device: Any = "cpu"):
    """The input tensor of case ``name`` on ``rank`` (deterministic)."""
    import torch
    shape_of, dtype, view = CASES[name]
    shape = shape_of(world_size)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 64 + rank)
    if view == "random":
        t = torch.randn(shape, generator=g, dtype=getattr(torch, dtype)) * 10
    else:
        t = torch.randint(-50, 51, shape, generator=g).to(getattr(torch, dtype))
    if view == "transpose":
        t = t.t()                                    # shape (3, 5), not contiguous
    return t.to(device)


def compare_job(rank: int, world_size: int, fn: Callable, names: list[str], op: str = "sum",
                watch: bool = False) -> list[dict]:
    """In every rank: run ``fn`` and ``dist.all_reduce`` on each case; one row per case.

    ``fn(tensor)`` (or ``fn(tensor, op)`` when ``op="mean"``) all-reduces in place or returns
    the result. A row: case, ok, status ("ok", "wrong", "not done"), detail, digest (a hash of
    the result: all ranks must agree), sent (bytes sent, when ``watch``), collectives (those
    ``fn`` called, when ``watch``). Each row is also printed as an ``@labkit-row`` line, so the
    rows done survive a later case that raises or hangs. A case that raises ends the loop with
    an error naming it, so peers waiting for this rank fail fast instead of hanging.
    """
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for name in names:
        print(f"@labkit-case {name}", flush=True)   # where a hang happened, for the report
        x = case_tensor(name, rank, world_size, device)
        want = x.clone()
        dist.all_reduce(want)
        if op != "sum":
            want = want / world_size
        got, tr = x.clone(), None
        try:
            if watch:
                with tracing(torch.empty(0, device=device)) as tr:
                    out = fn(got)
            else:
                out = fn(got) if op == "sum" else fn(got, op)
        except NotImplementedError:
            rows.append(dict(case=name, ok=False, status="not done", detail="NotImplementedError",
                             digest=0, sent=0, collectives=[], numel=x.numel(),
                             element_size=x.element_size()))
            print("@labkit-row " + json.dumps(rows[-1]), flush=True)
            break
        except Exception as exc:
            raise RuntimeError(f"case {name!r} ({_describe(x)}): {type(exc).__name__}: {exc}") \
                from exc
        if isinstance(out, torch.Tensor):
            got = out
        ok, detail = _compare(got, want, x, CASES[name][2] == "random")
        rows.append(dict(case=name, ok=ok, status="ok" if ok else "wrong", detail=detail,
                         digest=_digest(got), numel=x.numel(), element_size=x.element_size(),
                         sent=sum(e["bytes"] for e in tr.events if e["op"] == "send") if tr else 0,
                         collectives=sorted(set(tr.collectives)) if tr else []))
        print("@labkit-row " + json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------ the exercise checker
def check_ring_exercise(fn: Callable, world_sizes: tuple = (2, 3, 4), timeout: float = 5.0,
                        names: list[str] | None = None) -> list:
    """Check the learner's ``fn(tensor)`` against ``dist.all_reduce``: one Case per tensor case.

    For each world size one job runs every case in :data:`CASES` (a stub stops at the first:
    "not done yet"). Then, on 3 and 4 ranks, a traffic case: a ring sends at most
    2(N-1)/N·S bytes per rank (the naive master approach sends (N-1)·S from rank 0).
    A deadlock fails that world size's remaining cases within ``timeout`` seconds and skips
    the larger world sizes. Returns ``list[Case]`` (see :mod:`labkit.grading.exercise`).

    Example::

        lk.exercise.check("03.ring_all_reduce", ring_all_reduce)   # calls this
    """
    names = list(CASES) if names is None else list(names)
    cases: list = []
    stopped = ""
    for n in world_sizes:
        labels = [f"{n} ranks, {name}" for name in names]
        labels += [f"{n} ranks, bytes sent per rank"] if n >= 3 else []
        if stopped:
            cases += [Case(label, False, stopped) for label in labels]
            continue
        res = run(compare_job, n, args=(fn, names, "sum", True), timeout=timeout,
                  deadline=timeout + 3, check=False, echo=False)
        rows = [_rows_of(res[r].stdout) for r in range(n)]
        if any(row["status"] == "not done" for rank_rows in rows for row in rank_rows):
            raise NotDone(f"{n} ranks")
        verdicts = [_verdict(n, name, rows, res) for name in names]
        if n >= 3:
            verdicts.append(_traffic(n, rows) if res.ok else (False, "not run: a case failed"))
        cases += [Case(label, *v) for label, v in zip(labels, verdicts)]
        if not res.ok and _stuck(res):
            stopped = f"not run: the job on {n} ranks deadlocked"
    return cases


def _stuck(res) -> bool:
    """Did the job deadlock (hung, or a rank's receive timed out)?"""
    return any(r.status == "hung" or "Timed out" in (r.error or "") for r in res.ranks)


def _failure(res):
    """The rank whose failure explains the job: a timeout or own error, not a peer's echo."""
    failed = [r for r in res.ranks if not r.ok]
    for good in (lambda r: r.status == "hung" or "Timed out" in (r.error or ""),
                 lambda r: "Connection closed" not in (r.error or "")
                 and "Connection reset" not in (r.error or "")):
        pick = [r for r in failed if good(r)]
        if pick:
            return pick[0]
    return failed[0] if failed else None


def _rows_of(stdout: str) -> list[dict]:
    return [json.loads(ln[len("@labkit-row "):]) for ln in stdout.splitlines()
            if ln.startswith("@labkit-row ")]


def _verdict(n: int, name: str, rows: list[list[dict]], res) -> tuple:
    """(passed, detail) of one case across all ranks of one job."""
    mine = [next((row for row in rank_rows if row["case"] == name), None) for rank_rows in rows]
    if all(row is not None for row in mine):
        bad = [(r, row) for r, row in enumerate(mine) if not row["ok"]]
        if bad:
            return False, f"rank {bad[0][0]}: {bad[0][1]['detail']}"
        used = sorted({c for row in mine for c in row["collectives"]})
        if used:
            return False, (f"called dist.{used[0]}: build the all-reduce from dist.isend/irecv "
                           f"(point-to-point messages) instead")
        if len({row["digest"] for row in mine}) > 1:
            return False, "ranks hold different results: every rank must end with the same tensor"
        return True, mine[0]["detail"]
    failed = _failure(res)
    reached = [_last_case(res[r].stdout) for r in range(n)]
    if name not in reached:
        stop = next((c for c in reached if c), "?")
        return False, f"not run: the job stopped at case {stop!r}"
    if failed is None:
        return False, "no result from some ranks"
    if _stuck(res):
        return False, (f"deadlock: rank {failed.rank} waited for a message that never came "
                       f"({_clean(failed.error or failed.describe())}). Does every send have a "
                       f"matching receive on the neighbour, posted at the same time?")
    if failed.status == "raised":
        return False, _clean((failed.error or "").split(": ", 1)[-1])
    return False, _clean(failed.describe())


def _clean(text: str) -> str:
    """Drop gloo's source locations ("[/__w/.../pair.cc:553] ") from an error message."""
    return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)


def _last_case(stdout: str) -> str | None:
    marks = [ln[len("@labkit-case "):] for ln in stdout.splitlines()
             if ln.startswith("@labkit-case ")]
    done = {row["case"] for row in _rows_of(stdout)}
    return next((c for c in reversed(marks) if c not in done), None)


def _traffic(n: int, rows: list[list[dict]]) -> tuple:
    sent = [next(row for row in rank_rows if row["case"] == "divisible") for rank_rows in rows]
    s = sent[0]["numel"] * sent[0]["element_size"]
    limit = 2 * (n - 1) / n * s
    if all(row["sent"] == 0 for row in sent):
        return True, "could not watch the messages (isend/irecv imported under another name?)"
    worst = max(range(n), key=lambda r: sent[r]["sent"])
    if sent[worst]["sent"] > limit + 2 * (n - 1) * sent[0]["element_size"]:
        return False, (f"rank {worst} sent {sent[worst]['sent']} bytes of a {s}-byte tensor; "
                       f"a ring sends 2(N-1)/N·S = {limit:.0f}. Send one chunk per step, not "
                       f"the whole tensor")
    most = max(r["sent"] for r in sent)
    return True, f"each rank sent at most {most} bytes (2(N-1)/N·S = {limit:.0f})"


def _describe(t) -> str:
    layout = "" if t.is_contiguous() else ", non-contiguous"
    return f"shape {tuple(t.shape)}, {str(t.dtype).replace('torch.', '')}{layout}"


def _compare(got, want, x, tolerant: bool) -> tuple[bool, str]:
    import torch
    if not isinstance(got, torch.Tensor):
        return False, f"got {type(got).__name__}, expected the all-reduced tensor"
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return False, f"dtype {got.dtype}, expected {want.dtype}"
    if tolerant:
        close = torch.isclose(got, want, rtol=1e-5, atol=1e-4)
    else:
        close = got == want
    if bool(close.all()):
        return True, f"{_describe(x)}: matches dist.all_reduce"
    bad = (~close).reshape(-1).nonzero()[0].item()
    flat_g, flat_w = got.reshape(-1), want.reshape(-1)
    return False, (f"{_describe(x)}: element {bad} is {flat_g[bad].item():g}, dist.all_reduce "
                   f"gives {flat_w[bad].item():g} ({int((~close).sum())} of {close.numel()} "
                   f"elements differ)")


def _digest(t) -> int:
    try:
        return zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes())
    except Exception:  # noqa: BLE001  (bfloat16 and friends)
        return hash(tuple(t.detach().cpu().reshape(-1).tolist()))


# ------------------------------------------------------------- quiz keys (notebook 03)
def rank2_step3_bytes(ring_trace: Trace) -> int:
    """Quiz key: bytes rank 2 sent in step 3 of the learner's traced ring run."""
    _need(ring_trace, "ring_trace", ranks=3, steps=3)
    return ring_trace.sent(2, step=3)


def master_bytes_received(naive_trace: Trace) -> int:
    """Quiz key: bytes rank 0 received in the learner's traced naive run."""
    _need(naive_trace, "naive_trace", ranks=2, steps=1)
    return naive_trace.received(0)


def _need(trace: Any, name: str, ranks: int, steps: int) -> None:
    if not isinstance(trace, Trace):
        raise ValueError(f"{name} is {type(trace).__name__}, not a Trace: run the cell that "
                         f"records it (lk.collectives.record(...)) first.")
    if trace.world_size < ranks or trace.steps < steps:
        raise ValueError(f"{name} has {trace.world_size} ranks and {trace.steps} steps; this "
                         f"question needs at least {ranks} ranks and {steps} steps.")
