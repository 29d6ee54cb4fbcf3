"""Checking an all-reduce against ``dist.all_reduce``, case by case (the notebook 03 §7 exercise).

The §2 build, one step of the ring's reduce-scatter (``03.reduce_scatter_step``), has its own
checker in :mod:`~labkit.collectives.check.step`; both read a failed job the same way
(:mod:`~labkit.collectives.check.runs`).

Each case of :data:`~labkit.collectives.check.cases.CASES` runs on real ranks
(:func:`~labkit.collectives.check.cases.compare_job`), on 2, 3 and 4 of them; on 3 and 4 the
traffic case checks that each rank sends at most 2(N-1)/N·S bytes. A case passes only when
every rank's result equals ``dist.all_reduce``'s, the ranks agree bit for bit, no collective
ran while the answer did, and neither did the lab's own ring (``lk.collectives.ring_all_reduce``
and the other :func:`~labkit.grading.references.reference` implementations). What the checker trusts (:mod:`labkit.grading.watch`):
every rank draws its inputs from a secret only it holds, so no rank can know another's tensor
without receiving it; gloo's flight recorder lists any collective the answer reached, whatever
the route; bytes come from the kernel's TCP counters of gloo's sockets (the TCPStore's left
out), and a right result whose rank sent fewer bytes than its own tensor holds came through a
side channel (the store, a file) and fails. A case the checker cannot verify fails and says
why. Exposed as ``lk.collectives.CASES`` and ``lk.collectives.check_ring_exercise``.
"""
from __future__ import annotations

import json
from typing import Callable

from ...grading.exercise import Case, NotDone
from ...grading.references import reference_problem
from ...runtime import run
from .cases import CASES, TRAFFIC, case_tensor, compare_job
from .runs import HEADER_BYTES as _HEADER_BYTES
from .runs import clean as _clean
from .runs import failure as _failure
from .runs import recorder_env as _recorder_env
from .runs import stuck as _stuck
from .step import STEP_CASES, check_reduce_scatter_step, replay, step_job, step_tensor

__all__ = ["CASES", "TRAFFIC", "case_tensor", "compare_job", "check_ring_exercise",
           "STEP_CASES", "check_reduce_scatter_step", "replay", "step_job", "step_tensor"]


# ------------------------------------------------------------------ the exercise checker
def check_ring_exercise(fn: Callable, world_sizes: tuple = (2, 3, 4), timeout: float = 5.0,
                        names: list[str] | None = None) -> list:
    """Check the learner's ``fn(tensor)`` against ``dist.all_reduce``: one Case per tensor case.

    For each world size one gloo job runs every case in :data:`CASES` (a stub stops at the
    first: "not done yet"). Then, on 3 and 4 ranks, the :data:`TRAFFIC` case: a ring sends at
    most 2(N-1)/N·S bytes per rank (the naive master approach sends (N-1)·S from rank 0). A
    case passes only if every rank's result is right, the ranks agree, no collective ran while
    the answer did (by any route) and, for the traffic case, the bytes were measured. A
    deadlock fails that world size's remaining cases within ``timeout`` seconds and skips the
    larger world sizes. Returns ``list[Case]`` (see :mod:`labkit.grading.exercise`).

    Example::

        lk.exercise.check("03.ring_all_reduce", ring_all_reduce)   # calls this
    """
    names = list(CASES) if names is None else list(names)
    cases: list = []
    stopped = ""
    for n in world_sizes:
        labels = [f"{n} ranks, {name}" for name in names]
        labels += [f"{n} ranks, {TRAFFIC}"] if n >= 3 else []
        if stopped:
            cases += [Case(label, False, stopped) for label in labels]
            continue
        # gloo: the flight recorder and the TCP counters are what the checker reads. Fresh
        # ranks: a warm rank's full flight recorder would make every read slow.
        res = run(compare_job, n, args=(fn, names, "sum", True), backend="gloo",
                  timeout=timeout, deadline=timeout + 3, check=False, echo=False, fresh=True,
                  env=_recorder_env())
        rows = [_rows_of(res[r]) for r in range(n)]
        if any(row["status"] == "not done" for rank_rows in rows for row in rank_rows):
            raise NotDone(f"{n} ranks")
        verdicts = [_verdict(n, name, rows, res) for name in names]
        if n >= 3:
            verdicts.append(_traffic(n, rows, res))
        cases += [Case(label, *v) for label, v in zip(labels, verdicts)]
        if not res.ok and _stuck(res):
            stopped = f"not run: the job on {n} ranks deadlocked"
    return cases


def _rows_of(rank) -> list[dict]:
    """A rank's rows: what it returned when it finished, else the rows it printed before."""
    if rank.ok and isinstance(rank.value, list):
        return rank.value
    return _printed_rows(rank.stdout)


def _printed_rows(stdout: str) -> list[dict]:
    return [json.loads(ln[len("@labkit-row "):]) for ln in stdout.splitlines()
            if ln.startswith("@labkit-row ")]


def _verdict(n: int, name: str, rows: list[list[dict]], res) -> tuple:
    """(passed, detail) of one case across all ranks of one job."""
    mine = [next((row for row in rank_rows if row["case"] == name), None) for rank_rows in rows]
    if all(row is not None for row in mine):
        problem = _watched_problem(mine)
        if problem:
            return False, problem
        bad = [(r, row) for r, row in enumerate(mine) if not row["ok"]]
        if bad:
            return False, f"rank {bad[0][0]}: {bad[0][1]['detail']}"
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


def _last_case(stdout: str) -> str | None:
    marks = [ln[len("@labkit-case "):] for ln in stdout.splitlines()
             if ln.startswith("@labkit-case ")]
    done = {row["case"] for row in _printed_rows(stdout)}
    return next((c for c in reversed(marks) if c not in done), None)


def _watched_problem(mine: list[dict]) -> str | None:
    """Why a case fails whatever its numbers: a rank unwatched, the lab's own all-reduce called,
    a collective it ran, or a right result with fewer bytes sent on gloo's sockets than the
    rank's own tensor holds."""
    for r, row in enumerate(mine):
        if row.get("unwatched"):
            return f"cannot verify on rank {r}: {row['unwatched']}"
    lab = reference_problem([n for row in mine for n in row.get("references", ())])
    if lab:
        return lab
    for r, row in enumerate(mine):
        if row["collectives"]:
            used = ", ".join(sorted({c.split(":")[-1] for c in row["collectives"]}))
            return (f"rank {r} ran a collective ({used}) while your function ran; gloo "
                    f"recorded it whatever the route (dist.*, the process group object, a "
                    f"group of your own). Build the all-reduce from dist.isend/irecv "
                    f"(point-to-point messages) instead")
    for r, row in enumerate(mine):
        need = row["numel"] * row["element_size"]
        if row["ok"] and row["sent"] < need:
            return (f"side channel: rank {r}'s result is right, but its gloo sockets sent "
                    f"{row['sent']} bytes for a {need}-byte tensor, and every rank's input has "
                    f"to leave it. The data went some way that is not point-to-point (the "
                    f"process group's TCPStore, a file, shared memory): send it with "
                    f"dist.isend/irecv")
    return None


def _traffic(n: int, rows: list[list[dict]], res) -> tuple:
    """The traffic case: right result, no collective, at most 2(N-1)/N·S bytes per rank."""
    sent = [next((row for row in rank_rows if row["case"] == TRAFFIC), None)
            for rank_rows in rows]
    if any(row is None for row in sent):
        return False, ("not run: a case failed" if not res.ok else
                       "cannot verify: a rank reported no traffic row")
    problem = _watched_problem(sent)
    if problem:
        return False, problem
    wrong = next((r for r, row in enumerate(sent) if not row["ok"]), None)
    if wrong is not None:
        return False, (f"not counted: the result was wrong on rank {wrong} "
                       f"({sent[wrong]['detail']}); bytes only count for a correct all-reduce")
    s = sent[0]["numel"] * sent[0]["element_size"]
    limit = 2 * (n - 1) / n * s
    worst = max(range(n), key=lambda r: sent[r]["sent"])
    most = sent[worst]["sent"]
    if most > limit + 2 * (n - 1) * _HEADER_BYTES:
        return False, (f"rank {worst} sent {most} bytes for a {s}-byte tensor; a ring sends "
                       f"2(N-1)/N·S = {limit:.0f} (plus gloo's headers). Send one chunk per "
                       f"step, not the whole tensor")
    return True, (f"each rank sent at most {most} bytes, counted on its TCP sockets "
                  f"(2(N-1)/N·S = {limit:.0f}, plus gloo's message headers)")

