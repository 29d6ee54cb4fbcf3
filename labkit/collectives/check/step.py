"""Checking one reduce-scatter step of the ring: notebook 03 §2's build, ``03.reduce_scatter_step``.

The learner writes ``reduce_scatter_step(chunks, rank, n, s)``: in step ``s`` (0 to n-2, as the
loop counts) pick the chunk this rank sends to its right neighbour and the chunk it receives
from its left one, and add what arrives into its own copy of that chunk. The checker provides
the rest: each rank's tensor, its chunks (``tensor_split(n)``, views of the tensor), the loop
over the steps, and the messages (``lk.collectives.send_right_recv_left``, which the answer
may call or not). Every case (:data:`STEP_CASES`: uneven chunks, empty chunks, a tensor large
enough to count bytes) runs in its own fresh gloo job on 2, 3 and 4 ranks, and passes only if:

* **every rank after every step** equals :func:`replay`, a one-process replay of the ring from
  the inputs the ranks report after they ran: rank r sends chunk (r - s) mod n in step s and
  adds chunk (r - s - 1) mod n, so that it ends with chunk (r + 1) mod n complete (what the
  all-gather then relies on). An indexing off by a step (steps numbered from 1, or ``s + 1``)
  is still a ring, a rotated one, that leaves every rank with one complete chunk, but not that
  one: it differs from the replay right after step 0 on every world size, and the case says
  how (:func:`_diagnose`). Checking only the end, or only "some chunk is complete", would pass it;
* the reduce-scatter runs **twice** in each job, on two tensors: a step that counts its own
  calls instead of reading ``s`` fails the second;
* **what each rank sent**, step by step (:class:`labkit.grading.watch.Watch`): no collective by
  any route (an ``all_reduce`` or ``reduce_scatter`` doing the work: gloo's flight recorder
  lists it); bytes on gloo's sockets at least the chunk the rank had to pass on (fewer: the data
  went another way, the store or a file: a side channel) and at most that chunk plus gloo's
  headers (more: not one chunk per step, e.g. the whole tensor; the ``"bytes per step"`` case is
  large enough to tell);
* **not the lab's own ring**: ``lk.collectives.ring_schedule`` and the others marked in
  :mod:`labkit.grading.references` fail the case, named.

Each rank draws its tensor from a secret only it holds (``os.urandom``), so no rank can know
another's chunk without receiving it, and a copy of the checker's generator or of
:func:`replay` inside the answer computes the wrong numbers. Integer values (1..10⁶ in float32:
four of them sum exactly) make the replay bit-exact whatever order an answer adds in.
"""
from __future__ import annotations

import os
import re
import zlib
from typing import Callable

from ...grading.exercise import Case, NotDone
from ...grading.references import reference_problem, references_used
from ...grading.watch import Watch
from ...runtime import run
from .runs import HEADER_BYTES, clean, failure, recorder_env, stuck

__all__ = ["STEP_CASES", "BYTES", "PASSES", "step_tensor", "step_job", "replay",
           "check_reduce_scatter_step"]

BYTES = "bytes per step"
# name -> elements of each rank's tensor on n ranks; every length leaves chunks of two sizes
STEP_CASES: dict[str, Callable[[int], int]] = {
    "uneven chunks": lambda n: 4 * n + 1,
    BYTES: lambda n: 3072 * n + 1,                 # 12 KiB chunks: gloo's headers are noise
    "empty chunks": lambda n: max(n - 2, 1),       # 1 or 2 elements: n-1 or n-2 chunks empty
}
PASSES = 2              # reduce-scatters per job, on fresh tensors: hidden counters show
# The lab's own all-reduces, its schedule, and notebook 06's ring halves.
_LAB = ("labkit.collectives.", "labkit.sharding.ring.")


def step_tensor(name: str, rank: int, world_size: int, salt: int = 0):
    """The input of case ``name`` on ``rank``: whole numbers 1..10⁶ in float32."""
    import torch
    g = torch.Generator().manual_seed(zlib.crc32(f"step/{name}/{rank}/{salt}".encode()))
    return torch.randint(1, 1_000_001, (STEP_CASES[name](world_size),), generator=g).float()


def step_job(rank: int, world_size: int, fn: Callable, name: str) -> dict:
    """In every rank: run the reduce-scatter loop with ``fn`` as its step, :data:`PASSES` times,
    and record the tensor after every step with what the rank did meanwhile.

    Returns ``{"not done": True}`` for a stub, else ``{"passes": [{"input", "steps"}]}``, each
    step ``{"state", "sent", "collectives", "unwatched", "references"}``.
    """
    n = world_size
    watcher = Watch()                          # all ranks together: it runs one all_reduce
    salt = int.from_bytes(os.urandom(8), "little")
    passes = []
    for p in range(PASSES):
        x = step_tensor(name, rank, n, salt + p)
        start, chunks, steps = x.clone(), x.tensor_split(n), []
        for s in range(n - 1):
            watcher.start()
            try:
                with references_used(*_LAB) as lab:
                    fn(chunks, rank, n, s)
            except NotImplementedError:
                return {"not done": True}
            seen = watcher.stop()
            steps.append(dict(state=x.clone(), sent=seen["sent"],
                              collectives=seen["collectives"], unwatched=seen["error"],
                              references=list(lab)))
        passes.append(dict(input=start, steps=steps))
    return {"not done": False, "passes": passes}


def replay(inputs: list, n: int, shift: int = 0) -> list[list]:
    """The ring's reduce-scatter in one process: ``states[s][r]``, rank r's tensor after step s.

    In step s rank r sends chunk (r - s - shift) mod n and its right neighbour adds it into the
    same chunk. ``shift=0`` is the ring of the lesson (rank r ends with chunk (r+1) mod n
    complete); another shift is the same ring rotated, which the diagnosis recognises.
    """
    x = [t.clone() for t in inputs]
    chunks = [t.tensor_split(n) for t in x]
    states = []
    for s in range(n - 1):
        sent = [chunks[r][(r - s - shift) % n].clone() for r in range(n)]
        for r in range(n):
            chunks[r][(r - s - 1 - shift) % n].add_(sent[(r - 1) % n])
        states.append([t.clone() for t in x])
    return states


# ------------------------------------------------------------------ the checker
def check_reduce_scatter_step(fn: Callable, world_sizes: tuple = (2, 3, 4),
                              timeout: float = 5.0, names: list[str] | None = None) -> list:
    """Check the learner's ``fn(chunks, rank, n, s)``: one :class:`Case` per world size and
    case of :data:`STEP_CASES`, each run in its own fresh gloo job (a deadlock or a crash costs
    that case only; a case that deadlocked is not run again on more ranks).

    Example::

        lk.exercise.check("03.reduce_scatter_step", reduce_scatter_step)   # calls this
    """
    names = list(STEP_CASES) if names is None else list(names)
    cases, hung = [], {}
    for n in world_sizes:
        for name in names:
            label = f"{n} ranks, {name}"
            if name in hung:
                cases.append(Case(label, False, f"not run: it deadlocked on {hung[name]} ranks"))
                continue
            res = run(step_job, n, args=(fn, name), backend="gloo", timeout=timeout,
                      deadline=timeout + 3, check=False, echo=False, fresh=True,
                      env=recorder_env())
            if _not_done(res):
                raise NotDone(label)
            if not res.ok and stuck(res) and _crashed(res) is None:
                hung[name] = n
            cases.append(Case(label, *_verdict(n, name, res)))
    return cases


def _not_done(res) -> bool:
    return any((r.ok and isinstance(r.value, dict) and r.value.get("not done"))
               or (r.error or "").startswith("NotImplementedError") for r in res.ranks)


def _verdict(n: int, name: str, res) -> tuple[bool, str]:
    """(passed, detail) of one case: the job, then what the ranks did, then their numbers."""
    if not res.ok:
        return False, _job_failure(res)
    values = [res[r].value for r in range(n)]
    if not all(isinstance(v, dict) and len(v.get("passes", ())) == PASSES for v in values):
        return False, "cannot verify: a rank returned no record of its steps"
    steps = [(p, s, r, values[r]["passes"][p]["steps"][s])
             for p in range(PASSES) for s in range(n - 1) for r in range(n)]
    for _, _, r, st in steps:
        if st["unwatched"]:
            return False, f"cannot verify on rank {r}: {st['unwatched']}"
    lab = reference_problem([ref for *_, st in steps for ref in st["references"]])
    if lab:
        return False, lab
    for _, s, r, st in steps:
        if st["collectives"]:
            used = ", ".join(sorted({c.split(":")[-1] for c in st["collectives"]}))
            return False, (f"rank {r} ran a collective ({used}) in step {s}: gloo's flight "
                           f"recorder lists every collective, whatever called it (dist.*, "
                           f"dist.reduce_scatter, which gloo runs as all_reduce calls, the "
                           f"process group object, a thread). A ring step is one message to "
                           f"the right and one from the left: "
                           f"lk.collectives.send_right_recv_left (or dist.isend/irecv)")
    for p in range(PASSES):
        inputs = [values[r]["passes"][p]["input"] for r in range(n)]
        got = [[values[r]["passes"][p]["steps"][s]["state"] for r in range(n)]
               for s in range(n - 1)]
        want = replay(inputs, n)
        wrong = _first_difference(got, want)
        if wrong:
            if p:
                return False, (f"the first reduce-scatter matched the replay, the second did "
                               f"not ({_diagnose(n, inputs, got, want, *wrong)}): does your "
                               f"step keep state between calls instead of reading s?")
            return False, _diagnose(n, inputs, got, want, *wrong)
    return _traffic(n, name, values)


def _first_difference(got, want):
    """(step, rank) of the first state that differs from the replay, or None."""
    import torch
    for s, (g_ranks, w_ranks) in enumerate(zip(got, want)):
        for r, (g, w) in enumerate(zip(g_ranks, w_ranks)):
            if not torch.equal(g, w):
                return s, r
    return None


def _diagnose(n: int, inputs: list, got, want, s: int, r: int) -> str:
    """Why rank r's tensor after step s differs from the replay, in words."""
    import torch
    for shift in range(1, n):                  # a ring, but a rotated one
        if _first_difference(got, replay(inputs, n, shift)) is None:
            ends = "r" if (1 - shift) % n == 0 else f"(r + {(1 - shift) % n}) mod n"
            return (f"every rank followed a ring, but a rotated one: in step 0 rank 0 sent "
                    f"chunk {-shift % n}, not its own chunk 0, so after the last step rank r "
                    f"holds chunk {ends} complete instead of chunk (r + 1) mod n, which the "
                    f"all-gather needs. s counts the steps from 0 (did you number them from 1?)")
    before = inputs[r] if s == 0 else got[s - 1][r]
    expected_before = inputs[r] if s == 0 else want[s - 1][r]
    bounds = _bounds(before.numel(), n)
    changed = [c for c, (a, b) in enumerate(bounds) if not torch.equal(got[s][r][a:b],
                                                                         before[a:b])]
    should = [c for c, (a, b) in enumerate(bounds) if not torch.equal(want[s][r][a:b],
                                                                        expected_before[a:b])]
    if not changed:
        return (f"rank {r}'s tensor did not change in step {s}: add the chunk that arrived into "
                f"this rank's copy in place (`recv += incoming`; the chunks are views of the "
                f"tensor, so a new tensor, or a name bound to one, changes nothing)")
    c = next(c for c, (a, b) in enumerate(bounds)
             if not torch.equal(got[s][r][a:b], want[s][r][a:b]))
    a, b = bounds[c]
    if should == [c] and torch.equal(got[s][r][a:b], want[s][r][a:b] - expected_before[a:b]):
        return (f"after step {s} rank {r}'s chunk {c} holds only what arrived: add it into the "
                f"chunk (`+=`) instead of replacing it, a ring sums")
    where = (f"your step changed chunk{'s' * (len(changed) > 1)} "
             f"{', '.join(map(str, changed))} of rank {r}; the ring adds into chunk "
             f"{', '.join(map(str, should)) or 'none'} there")
    return (f"after step {s} rank {r}'s chunk {c} is {_short(got[s][r][a:b])}, the replay's is "
            f"{_short(want[s][r][a:b])} ({where})")


def _bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of ``tensor_split(n)`` on ``numel`` elements."""
    base, extra = divmod(numel, n)
    out, a = [], 0
    for c in range(n):
        b = a + base + (c < extra)
        out.append((a, b))
        a = b
    return out


def _short(t) -> str:
    vals = [f"{v:g}" for v in t[:3].tolist()]
    return "[" + ", ".join(vals) + (", …]" if t.numel() > 3 else "]")


def _traffic(n: int, name: str, values: list) -> tuple[bool, str]:
    """Right numbers everywhere: did each rank send its one chunk per step, no less, no more?"""
    numel = values[0]["passes"][0]["input"].numel()
    sizes = [(b - a) * 4 for a, b in _bounds(numel, n)]
    most = 0
    for p in range(PASSES):
        for s in range(n - 1):
            for r in range(n):
                sent, chunk = values[r]["passes"][p]["steps"][s]["sent"], sizes[(r - s) % n]
                if sent < chunk:
                    return False, (f"side channel: rank {r}'s numbers are right after step {s}, "
                                   f"but its gloo sockets sent {sent} bytes in that step, fewer "
                                   f"than the {chunk}-byte chunk it had to pass on: the data "
                                   f"went some way that is not a message between ranks (the "
                                   f"process group's TCPStore, a file), or in another step. "
                                   f"Send this step's chunk in this step, with "
                                   f"lk.collectives.send_right_recv_left")
                if sent > chunk + 2 * HEADER_BYTES:
                    return False, (f"rank {r} sent {sent} bytes in step {s}, for a {chunk}-byte "
                                   f"chunk: a ring step passes one chunk, about S/n bytes, not "
                                   f"the whole tensor ({numel * 4} bytes)")
                most = max(most, sent - chunk)
    if name == BYTES:
        return True, f"one chunk per step, {max(sizes)} bytes at most, plus {most} of headers"
    return True, "matches the replay after every step, twice"


def _crashed(res):
    """The rank gloo aborted (a message bigger than its receive buffer), if any: its peers then
    time out waiting for it, but it is the one that explains the job."""
    return next((r for r in res.ranks if r.status == "signaled"), None)


def _job_failure(res) -> str:
    """The failed job in one sentence, with what usually causes it in this build."""
    crashed = _crashed(res)
    if crashed is not None and "size doesn't match" in (crashed.stderr or ""):
        sizes = re.search(r"(\d+) vs (\d+)", crashed.stderr)
        got = f" ({sizes.group(1)} bytes for {sizes.group(2)})" if sizes else ""
        return (f"rank {crashed.rank} got a message bigger than the chunk it received "
                f"into{got}, and gloo aborted it ({crashed.signal}). In each step the chunk a "
                f"rank sends and the chunk its right neighbour receives must be the same one")
    bad = crashed or failure(res)
    if bad is None:
        return "no result from some ranks"
    if stuck(res) and crashed is None:
        return (f"deadlock: rank {bad.rank} waited for a message that never came "
                f"({clean(bad.error or bad.describe())[:160]}). In each step the chunk a rank "
                f"sends and the chunk its right neighbour receives must be the same one (an "
                f"empty chunk is not sent)")
    if bad.status == "raised":
        return f"rank {bad.rank} raised {clean(bad.error or '')[:300]}"
    return clean(bad.describe())[:300]
