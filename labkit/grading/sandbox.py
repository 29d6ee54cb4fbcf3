"""The checker process: where a submission's own objects are loaded and run, never the grader.

A pickle can run code when it is loaded, so the grader (:mod:`labkit.grading.grader`) only ever
reads plain data (JSON answers). Questions whose scoring needs the submission's objects — an
exercise (its function, under the bank's checker, which starts real ranks) or a computed
question (the bank's key, called on the notebook's inputs) — are scored here: one fresh
process per submission (``python -m labkit.grading.sandbox REQUEST``) that loads the pickles,
runs each check under a time limit, and writes each :class:`~labkit.grading.score.Score` back
as JSON as soon as it is done. It runs in a process tree of its own
(:func:`labkit.runtime.procs.run`): whatever is still running when it ends or runs past its
limit (the process, its ranks) is killed.

This isolates the grader from the submission; it is not an operating-system sandbox (the
checker process has the grader's user rights), so grade untrusted work as an unprivileged
user.
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..runtime import procs
from .bank import Bank, Question, load_bank
from .exercise import Case
from .score import Score

__all__ = ["score_in_sandbox", "score_trusted", "read_scores", "KEY_TIMEOUT_S"]

KEY_TIMEOUT_S = 60.0     # a quiz key is quick; an exercise gets the grader's check timeout
_START_S = 60.0          # the process's own start (torch import) on a loaded machine


def score_in_sandbox(bank: Bank, questions: list[Question], collected: dict[str, tuple],
                     check_timeout: float) -> dict[str, Score]:
    """Score ``questions`` in a checker process; their id -> Score (an error Score for each
    question the process could not finish)."""
    if not questions:
        return {}
    with tempfile.TemporaryDirectory(prefix="labkit-sandbox-") as tmp:
        folder = Path(tmp)
        names = {q.variable for q in questions} | {n for q in questions for n in q.inputs}
        states = {}
        for name in names:
            state, data = collected.get(name, ("lost", ""))
            if state == "pickle":
                (folder / f"{name}.pkl").write_bytes(data)
                data = ""
            states[name] = [state, data]
        request = {"bank": str(bank.path), "questions": [q.id for q in questions],
                   "states": states, "check_timeout": check_timeout}
        (folder / "request.json").write_text(json.dumps(request, default=str))
        limit = _START_S + sum(check_timeout if q.kind == "exercise" else KEY_TIMEOUT_S
                               for q in questions)
        try:
            code, _, err = procs.run("checker process",
                                     [sys.executable, "-m", "labkit.grading.sandbox", tmp], limit,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
            why = (f"the checker process exited with code {code}: "
                   f"{err.decode(errors='replace').strip()[-300:]}")
        except subprocess.TimeoutExpired:
            why = f"the checker process ran past its {limit:.0f} s limit and was stopped"
        done = read_scores(folder / "results.jsonl")
    return {q.id: done.get(q.id) or Score(q.id, 0.0, q.points, "error", f"not graded: {why}")
            for q in questions}


def read_scores(path: Path) -> dict[str, Score]:
    """The Scores written to ``path`` as JSON lines (by the checker process or
    :func:`labkit.grading.kernel.checked_source`): id -> Score; unreadable lines are skipped."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
                out[d["id"]] = Score(**{**d, "cases": [Case(**c) for c in d["cases"]]})
            except (ValueError, TypeError, KeyError):
                continue
    return out


# ------------------------------------------------------------------ the checker process
class _CheckTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that checkers' ``except Exception`` let it through."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def alarm(_sig, _frame):
        raise _CheckTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _load(states: dict, name: str) -> tuple[str, Any]:
    state, data = states.get(name, ("lost", ""))
    if state != "pickle":
        return state, data
    import cloudpickle

    try:
        return "ok", cloudpickle.loads(data)
    except Exception as exc:  # noqa: BLE001
        return "error", f"could not be loaded: {type(exc).__name__}: {exc}"


def _score_one(q: Question, states: dict, check_timeout: float) -> Score:
    from .scoring import score

    state, value = _load(states, q.variable)
    if state == "lost":
        return Score(q.id, 0.0, q.points, "error", "not graded: the answers could not be "
                     "collected from the kernel (see the notes)")
    if state == "error":
        return Score(q.id, 0.0, q.points, "error", f"{q.variable} could not be collected: {value}")
    inputs = {}
    for name in q.inputs:
        s, v = _load(states, name)
        inputs[name] = v if s == "ok" else None
    limit = check_timeout if q.kind == "exercise" else KEY_TIMEOUT_S
    try:
        with _time_limit(limit):
            s = score(q, value if state == "ok" else None, inputs)
    except _CheckTimeout:
        return Score(q.id, 0.0, q.points, "error", f"the check ran past {limit:g} s and was "
                     f"stopped (an endless loop or a deadlock in {q.variable}?)")
    except Exception as exc:  # noqa: BLE001  (a key or checker bug must not stop the gradebook)
        return Score(q.id, 0.0, q.points, "error", f"the check failed: {type(exc).__name__}: {exc}")
    if state == "missing":
        s.feedback = f"not answered: the notebook never defines {q.variable}"
    return s


def score_trusted(questions: list[Question], collected: dict[str, tuple],
                  check_timeout: float, checked: dict[str, Score] | None = None
                  ) -> dict[str, Score]:
    """Score ``questions`` in THIS process: only for notebooks the lab itself wrote (its
    ``solutions/`` and untouched ``notebooks/``, graded by the test suite), never for a
    submission. It saves a checker process, and its cold start, per notebook. An exercise in
    ``checked`` (what the notebook's own check cell scored, on the very function collected)
    keeps that Score instead of running its checker a second time."""
    checked = checked or {}
    return {q.id: checked.get(q.id) or _score_one(q, collected, check_timeout)
            for q in questions}


def main(argv: list[str] | None = None) -> int:
    folder = Path((sys.argv[1:] if argv is None else argv)[0])
    request = json.loads((folder / "request.json").read_text())
    bank = load_bank(request["bank"])
    states = {name: (state, (folder / f"{name}.pkl").read_bytes() if state == "pickle" else data)
              for name, (state, data) in request["states"].items()}
    try:
        with open(folder / "results.jsonl", "a") as out:
            for qid in request["questions"]:
                s = _score_one(bank.questions[qid], states, request["check_timeout"])
                out.write(json.dumps(s.to_dict(), default=str) + "\n")
                out.flush()
    finally:
        from ..runtime.launch import shutdown
        shutdown()   # the checkers' ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
