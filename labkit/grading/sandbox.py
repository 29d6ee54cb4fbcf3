"""The checker process: where a submission's own objects are loaded and run, never the grader.

A pickle can run code when it is loaded, so the grader (:mod:`labkit.grading.grader`) only ever
reads plain data (JSON answers). Questions whose scoring needs the submission's objects — an
exercise (its function, under the bank's checker, which starts real ranks) or a computed
question (the bank's key, called on the notebook's inputs) — are scored here: one fresh
process per submission (``python -m labkit.grading.sandbox REQUEST``) that loads the pickles
and runs each check under a time limit (:func:`labkit.grading.scoring.score_objects`, the same
path that scores plain answers in the grader), and writes each
:class:`~labkit.grading.score.Score` back as JSON as soon as it is done. It runs in a process tree of its own
(:func:`labkit.runtime.procs.run`): whatever is still running when it ends or runs past its
limit (the process, its ranks) is killed.

This isolates the grader from the submission; it is not an operating-system sandbox (the
checker process has the grader's user rights), so grade untrusted work as an unprivileged
user.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ..runtime import procs
from .bank import Bank, Question, load_bank
from .exercise import Case
from .score import STATUSES, Score
from .scoring import KEY_TIMEOUT_S, score_objects

__all__ = ["score_in_sandbox", "read_scores"]

START_S = 60.0           # the process's own start (torch import) on a loaded machine


def score_in_sandbox(bank: Bank, questions: list[Question], collected: dict[str, tuple],
                     check_timeout: float, key_timeout: float = KEY_TIMEOUT_S
                     ) -> dict[str, Score]:
    """Score ``questions`` in a checker process; their id -> Score (an error Score for each
    question the process could not finish). Each exercise check runs under ``check_timeout``
    seconds, each computed key under ``key_timeout``, the process under their sum and
    :data:`START_S`."""
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
                   "states": states, "check_timeout": check_timeout,
                   "key_timeout": key_timeout}
        (folder / "request.json").write_text(json.dumps(request, default=str))
        limit = START_S + sum(check_timeout if q.kind == "exercise" else key_timeout
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
    out = {}
    for q in questions:
        s = done.get(q.id)
        wrong = None if s is None else _impossible(q, s)
        if wrong:
            why = (f"the checker process reported a score that cannot be right ({wrong}): code "
                   f"the submission ran there may have written it")
        out[q.id] = s if s is not None and not wrong else \
            Score(q.id, 0.0, q.points, "error", f"not graded: {why}")
    return out


def _impossible(q: Question, s: Score) -> str | None:
    """Why the Score ``s`` cannot be what the checker gave question ``q`` (the grader's own
    copy of the bank), or None. The checker process runs the submission's code, which could
    write any line into its results: a line that survives this is one the real checker could
    have written (all cases passing, for an exercise: see the README on what stays out of
    reach)."""
    if s.id != q.id or s.max_points != q.points:
        return "it is for another question"
    if s.status not in STATUSES or not 0 <= s.points <= q.points:
        return f"{s.points:g} of {q.points:g} points, status {s.status!r}"
    if q.kind == "exercise" and s.cases:
        n, passed = len(s.cases), sum(bool(c.passed) for c in s.cases)
        want = q.points if passed == n else (q.points * passed / n if q.partial else 0.0)
        if abs(s.points - want) > 1e-9:
            return f"{s.points:g} points for {passed} of {n} cases passing"
    elif s.points not in (0.0, q.points) or (q.kind == "exercise" and s.points):
        return f"{s.points:g} of {q.points:g} points without cases"
    return None


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
def main(argv: list[str] | None = None) -> int:
    folder = Path((sys.argv[1:] if argv is None else argv)[0])
    request = json.loads((folder / "request.json").read_text())
    bank = load_bank(request["bank"])
    states = {name: (state, (folder / f"{name}.pkl").read_bytes() if state == "pickle" else data)
              for name, (state, data) in request["states"].items()}
    try:
        with open(folder / "results.jsonl", "a") as out:
            questions = [bank.questions[qid] for qid in request["questions"]]
            for s in score_objects(questions, states, request["check_timeout"],
                                   key_timeout=request["key_timeout"]):
                out.write(json.dumps(s.to_dict(), default=str) + "\n")   # each as it is done
                out.flush()
    finally:
        from ..runtime.launch import shutdown
        shutdown()   # the checkers' ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
