"""The exercise's tensors and the job each rank runs on them (notebook 03 §7).

:data:`CASES` are the tensors a hand-written all-reduce gets wrong; :func:`compare_job` runs
the answer and ``dist.all_reduce`` on each, in every rank, and reports one row per case. The
verdicts over all ranks are :mod:`labkit.collectives.check`'s.

Integer-valued inputs (1..10⁶: never zero, so a missing contribution always shows; wide, so
an answer that guesses cannot hit the sum by chance — with 1..50 a one-element case was right
for a guessing answer in about 1 run in 35) make the expected sums exact whatever order a ring
adds them in (4 ranks sum below 2²⁴, float32's exact integers); ``"random floats"`` is compared with
a tolerance. The reference ``dist.all_reduce`` runs only after the answer has returned, and in
the exercise each rank draws its inputs from a secret only it holds: no rank can know another
rank's tensor without receiving it.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Callable

from ...grading.references import references_used
from ...grading.watch import Watch

__all__ = ["CASES", "TRAFFIC", "case_tensor", "compare_job"]

# name -> (shape as a function of the world size n, dtype, view)
CASES: dict[str, tuple[Callable[[int], tuple], str, str]] = {
    "divisible": (lambda n: (4 * n,), "float32", ""),
    "not divisible": (lambda n: (4 * n + 1,), "float32", ""),
    "fewer elements than ranks": (lambda n: (max(n - 1, 1),), "float32", ""),
    "single element": (lambda n: (1,), "float32", ""),
    "empty": (lambda n: (0,), "float32", "empty"),
    "float64, 2-D": (lambda n: (3, 5), "float64", ""),
    "int64": (lambda n: (2 * n + 3,), "int64", ""),
    "3-D": (lambda n: (2, 3, 4), "float32", ""),
    "non-contiguous": (lambda n: (5, 3), "float32", "transpose"),
    "random floats": (lambda n: (1000,), "float32", "random"),
}
# The lab's own all-reduces, and notebook 06's ring halves: any of them does the exercise's work.
_LAB = ("labkit.collectives.", "labkit.sharding.ring.")
# The traffic case (3 and 4 ranks): large enough that gloo's message headers are noise.
TRAFFIC = "bytes sent per rank"
_EXTRA = {TRAFFIC: (lambda n: (3072 * n,), "float32", "random"),
          "empty, then": (lambda n: (n + 1,), "float32", "")}


def case_tensor(name: str, rank: int, world_size: int, device: Any = "cpu", salt: int = 0):
    """The input tensor of case ``name`` on ``rank`` (deterministic for a given ``salt``)."""
    import torch
    shape_of, dtype, view = CASES.get(name) or _EXTRA[name]
    shape = shape_of(world_size)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}/{salt}".encode()))
    if view == "random":
        t = torch.randn(shape, generator=g, dtype=getattr(torch, dtype)) * 10
    else:
        t = torch.randint(1, 1_000_001, shape, generator=g).to(getattr(torch, dtype))
    if view == "transpose":
        t = t.t()                                    # shape (3, 5), not contiguous
    return t.to(device)


def compare_job(rank: int, world_size: int, fn: Callable, names: list[str], op: str = "sum",
                watch: bool = False) -> list[dict]:
    """In every rank: run ``fn`` and ``dist.all_reduce`` on each case; one row per case.

    ``fn(tensor)`` (or ``fn(tensor, op)`` when ``op="mean"``) all-reduces in place or returns
    the result. A row: case, ok, status ("ok", "wrong", "not done"), detail, digest (a hash of
    the result: all ranks must agree), and, when ``watch``: sent (bytes this rank's TCP sockets
    sent while ``fn`` ran), collectives (those gloo ran meanwhile), unwatched (why the rank
    could not be watched, or ""), references (the lab's own all-reduces ``fn`` called,
    :mod:`labkit.grading.references`). With ``watch`` the inputs come from a secret each rank draws
    for itself, and 3+ ranks add the :data:`TRAFFIC` case. Each row is also printed as an
    ``@labkit-row`` line, so the rows done survive a later case that raises or hangs. A case
    that raises ends the loop with an error naming it, so peers waiting for this rank fail fast.
    """
    import torch

    from ...common.ranks import uses_nccl
    device = torch.device("cuda", rank) if uses_nccl() else torch.device("cpu")
    watcher = Watch() if watch else None
    salt = int.from_bytes(os.urandom(8), "little") if watch else 0
    items = list(names) + ([TRAFFIC] if watch and world_size >= 3 else [])
    rows = []
    for name in items:
        print(f"@labkit-case {name}", flush=True)   # where a hang happened, for the report
        x = case_tensor(name, rank, world_size, device, salt)
        inputs = [x] + ([case_tensor("empty, then", rank, world_size, device, salt)]
                        if _view(name) == "empty" else [])
        if watcher:
            watcher.start()
        try:
            with references_used(*_LAB) as lab:
                outs = [_call(fn, t.clone(), op) for t in inputs]
        except NotImplementedError:
            rows.append(dict(case=name, ok=False, status="not done", detail="NotImplementedError",
                             digest=0, sent=0, collectives=[], unwatched="", numel=x.numel(),
                             element_size=x.element_size(), references=[]))
            print("@labkit-row " + json.dumps(rows[-1]), flush=True)
            break
        except Exception as exc:
            raise RuntimeError(f"case {name!r} ({_describe(x)}): {type(exc).__name__}: {exc}") \
                from exc
        seen = watcher.stop() if watcher else {"collectives": [], "sent": 0, "error": ""}
        ok, detail = _check_outputs(outs, inputs, op, world_size, _view(name) == "random")
        rows.append(dict(case=name, ok=ok, status="ok" if ok else "wrong", detail=detail,
                         digest=_digest(outs[-1]), numel=x.numel(), element_size=x.element_size(),
                         sent=seen["sent"], collectives=seen["collectives"],
                         unwatched=seen["error"], references=lab))
        print("@labkit-row " + json.dumps(rows[-1]), flush=True)
    return rows


def _view(name: str) -> str:
    return (CASES.get(name) or _EXTRA[name])[2]


def _call(fn: Callable, t, op: str):
    """The answer's result for ``t``: what it returned if a tensor, else ``t`` (in place)."""
    import torch
    out = fn(t) if op == "sum" else fn(t, op)
    return out if isinstance(out, torch.Tensor) else t


def _check_outputs(outs: list, inputs: list, op: str, world_size: int,
                   tolerant: bool) -> tuple[bool, str]:
    """Compare each result with ``dist.all_reduce`` of its input, run only now."""
    import torch.distributed as dist
    details = []
    for i, (got, x) in enumerate(zip(outs, inputs)):
        want = x.clone()
        dist.all_reduce(want)
        if op != "sum":
            want = want / world_size
        ok, detail = _compare(got, want, x, tolerant)
        if not ok:
            return False, detail if i == 0 else (f"the empty call went through, but the call "
                                                 f"right after it is wrong: {detail} (a "
                                                 f"message left in flight?)")
        details.append(detail)
    if len(details) > 1:
        return True, f"{details[0]}, and the call after it too"
    return True, details[0]



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
