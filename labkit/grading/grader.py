'''The auto-grader: run each submission in a fresh kernel, score its answers with our own key.

::

    python -m labkit grade alice_03.ipynb                      # one submission: a report
    python -m labkit grade submissions/ --json grades.json     # a folder: every *.ipynb in it
    python -m labkit grade submissions/ --csv book.csv   # (default: submissions/gradebook.csv)

For each submission the grader

1. reads the file; an empty, truncated or non-notebook file gets a clear error
   for that submission and the others are still graded;
2. finds its question bank (``--bank``, else metadata ``labkit.bank`` that the
   generator writes, else the file name, else the question ids in its source);
3. executes it in a fresh kernel (:mod:`labkit.grading.kernel`): per-cell and
   per-notebook time limits, past cells that raise, through infinite loops
   (interrupt), ``sys.exit``/``os._exit``/``exit()`` and interrupt-proof loops
   (the cell is skipped and the notebook re-run without it), deadlocked ranks
   (cell timeout; the runner kills the ranks); no process is left behind;
4. collects every bank ``variable`` (answers and exercise functions) and key
   ``inputs`` from the kernel and scores them with the bank's own key and
   checkers (:func:`labkit.grading.scoring.score`): answers cross as plain data
   (JSON) and are scored in this process; exercise functions and a key's inputs
   cross as pickles that only the checker process loads
   (:mod:`labkit.grading.sandbox`), so nothing a submission produced ever runs
   in the grader. Printed output and check cells are never read, so a notebook
   that prints "100/100" or edits its check cells gains nothing. Each exercise
   check has its own time limit (``--check-timeout``).

``--jobs N`` grades N submissions at once (a class folder on a machine with cores to
spare); the report and the gradebook keep the submissions' order.

Outputs: a readable report on stdout (``--report FILE`` too), per-question
points and feedback as JSON (``--json``), and for a folder a CSV gradebook.
Exit status: 0 when every submission was graded, 1 when some could not be,
2 for bad arguments. ``--bank-dir`` (or ``$LABKIT_QUIZ_DIR``) grades against
another folder of banks (the tests use a tiny one). The kernel runs with
``LABKIT_GRADING=1`` and ``LABKIT_QUIZ_DIR`` set to the grader's banks, in an
empty temporary working directory per submission.

From Python::

    from labkit.grading.grader import Options, grade_notebook
    result = grade_notebook("alice.ipynb", Options(cell_timeout=60))
    result["points"], result["questions"][0]["feedback"]
'''
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .bank import Bank, BankError, all_banks, bank_dir
from .kernel import checked_source, collector_source, execute, read_values
from .sandbox import read_scores, score_in_sandbox
from .score import MARKS, Score
from .scoring import KEY_TIMEOUT_S, score_collected, score_objects

__all__ = ["Options", "SubmissionError", "read_submission", "bank_for", "grade_notebook",
           "score_bank", "grade_lesson_kernel", "lesson_grade_problems", "grade_paths",
           "submissions_in", "format_report", "write_csv", "main"]


class SubmissionError(Exception):
    """This file cannot be graded (empty, truncated, not a notebook, unknown bank)."""


@dataclass
class Options:
    """Limits and sources of one grading run (CLI flags of the same names)."""

    cell_timeout: float = 120.0       # seconds per cell
    notebook_timeout: float = 900.0   # seconds for the whole notebook, re-runs included
    check_timeout: float = 300.0      # seconds per exercise check in the grader
    key_timeout: float = KEY_TIMEOUT_S  # seconds per computed key (run on the notebook's inputs)
    collect_timeout: float = 60.0     # seconds to pickle the answers in the kernel
    max_restarts: int = 2             # re-runs after a cell kills the kernel
    grace: float = 5.0                # seconds an interrupted cell gets before the kernel is killed
    bank: str | None = None           # force a bank, e.g. "03_ring_allreduce"
    bank_dir: str | None = None       # folder of banks (default: the repository's quizzes/)

    def banks_path(self) -> Path:
        return Path(self.bank_dir) if self.bank_dir else bank_dir()


# ------------------------------------------------------------- reading
def read_submission(path: str | os.PathLike):
    """The notebook in ``path``, or :class:`SubmissionError` saying what is wrong with the file."""
    import nbformat

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SubmissionError(f"cannot read the file: {exc.strerror}") from None
    if not data.strip():
        raise SubmissionError(f"the file is empty ({len(data)} bytes): nothing was submitted")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":     # cut inside a multi-byte character
            raise SubmissionError("the notebook is truncated: it stops in the middle of a "
                                  "character (an upload or a save cut short); re-download or "
                                  "re-save it and submit again") from None
        raise SubmissionError("not a notebook: the file is binary, not the JSON text of an "
                              ".ipynb (was another file uploaded?)") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        if _stops_early(text, exc):
            raise SubmissionError(f"the notebook is truncated: its JSON stops early, in the "
                                  f"middle of line {text.count(chr(10)) + 1} (an upload or a "
                                  f"save cut short); re-download or re-save it and submit "
                                  f"again") from None
        raise SubmissionError(f"not a valid notebook: its JSON breaks at line {exc.lineno}, "
                              f"column {exc.colno} of {text.count(chr(10)) + 1} lines "
                              f"({exc.msg}): the file was damaged or edited by hand there; "
                              f"re-save it from Jupyter or repair that line") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        raise SubmissionError("not a notebook: valid JSON, but without a list of cells")
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as exc:  # noqa: BLE001  (nbformat raises many kinds)
        raise SubmissionError(f"not a readable notebook: {type(exc).__name__}: {exc}") from None


# the part of one token a cut can leave: a literal, a number, an escape in a string
_TOKEN_PART = re.compile(r"[\w.+\-\\]*")


def _stops_early(text: str, exc: json.JSONDecodeError) -> bool:
    """True when ``text`` is JSON cut short: the parser failed at the end of the text (a
    string still open, or nothing left but part of one token) with a ``{``/``[`` still open.
    A break earlier in the text (garbage in the middle) is not a truncation, whatever the
    brackets and quotes of the whole text add up to."""
    if exc.msg.startswith("Unterminated string"):   # raised only when the text ends in it
        at_end = True
    else:
        at_end = bool(_TOKEN_PART.fullmatch(text[exc.pos:].strip()))
    return at_end and exc.msg != "Extra data" and _ends_early(text)


def _ends_early(text: str) -> bool:
    """True when ``text`` ends inside a string or with a ``{``/``[`` still open."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_string or depth > 0


def bank_for(nb, path: Path, banks: dict[str, Bank], forced: str | None = None) -> Bank:
    """The bank a submission answers: ``forced``, its metadata, its file name, its ids."""
    if forced:
        if forced not in banks:
            raise SubmissionError(f"--bank {forced}: no such bank (have: {', '.join(banks)})")
        return banks[forced]
    meta = (nb.metadata.get("labkit") or {}).get("bank")
    if isinstance(meta, str) and meta in banks:
        return banks[meta]
    named = [name for name in banks if name in path.name]
    if named:
        return banks[max(named, key=len)]
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    prefixes = Counter(re.findall(r"""["'](\d\d)\.[A-Za-z_]\w*["']""", source))
    for prefix, _ in prefixes.most_common():
        matches = [b for b in banks.values() if b.prefix == prefix]
        if len(matches) == 1:
            return matches[0]
    raise SubmissionError(f"cannot tell which notebook this is (no labkit.bank metadata, no bank "
                          f"name in the file name, no known question ids); pass --bank NAME, "
                          f"one of: {', '.join(banks) or 'none found'}")


# ------------------------------------------------------------- grading
def grade_notebook(path: str | os.PathLike, opts: Options | None = None) -> dict:
    """Grade one submission; never raises for a bad submission (see ``status`` and ``error``)."""
    opts = opts or Options()
    path = Path(path)
    t0 = time.monotonic()
    result: dict[str, Any] = {"submission": str(path), "notebook": None, "status": "error",
                              "error": None, "points": 0.0, "max_points": 0.0, "questions": [],
                              "cells": [], "notes": [], "wall_s": 0.0}
    try:
        nb = read_submission(path)
        bank = bank_for(nb, path, all_banks(opts.banks_path()), opts.bank)
    except (SubmissionError, BankError) as exc:
        result["error"] = str(exc)
        result["wall_s"] = time.monotonic() - t0
        return result
    result.update(notebook=bank.name, max_points=bank.max_points)
    env = {"LABKIT_QUIZ_DIR": str(opts.banks_path().resolve()), "LABKIT_GRADING": "1"}
    try:
        ex = execute(nb, bank.names, pickled=bank.pickled, cell_timeout=opts.cell_timeout,
                             notebook_timeout=opts.notebook_timeout,
                             collect_timeout=opts.collect_timeout, max_restarts=opts.max_restarts,
                             grace=opts.grace, env=env)
    except Exception as exc:  # noqa: BLE001  (e.g. the kernel cannot start)
        result["error"] = f"the notebook could not be executed: {type(exc).__name__}: {exc}"
        result["wall_s"] = time.monotonic() - t0
        return result
    scores = score_bank(bank, ex.values, opts)
    result.update(status="graded", points=round(sum(s.points for s in scores), 6),
                  questions=[{"kind": bank.questions[s.id].kind, **s.to_dict()} for s in scores],
                  cells=[vars(c) for c in ex.cells], notes=ex.notes,
                  wall_s=time.monotonic() - t0)
    return result


def score_bank(bank: Bank, collected: dict[str, tuple[str, Any]],
                    opts: Options | None = None, trusted: bool = False,
                    checked: dict[str, Score] | None = None) -> list[Score]:
    """Score every question of ``bank`` from the values collected out of a kernel.

    ``collected`` is what :func:`labkit.grading.kernel.read_values` returns: plain answers are
    scored here; exercises and computed questions, which run the submission's own objects, in
    the checker process (:func:`labkit.grading.sandbox.score_in_sandbox`). The lab's pytest
    plugin grades nbval's own kernel with this too, with ``trusted=True``: the lab's own
    notebooks are scored in this process (:func:`labkit.grading.scoring.score_objects`), and
    the exercises in ``checked`` keep the Score their own check cell gave.
    """
    opts = opts or Options()
    remote = [q for q in bank.questions.values() if q.runs_submission_code]
    if trusted:
        sandboxed = {s.id: s for s in score_objects(remote, collected, opts.check_timeout,
                                                    checked, opts.key_timeout)}
    else:
        sandboxed = score_in_sandbox(bank, remote, collected, opts.check_timeout,
                                     opts.key_timeout)
    return [sandboxed[q.id] if q.runs_submission_code
            else score_collected(q, *collected.get(q.variable, ("lost", None)))
            for q in bank.questions.values()]


def grade_lesson_kernel(nb, path: Path, run_cell: Callable[[str], None],
                        solved: bool) -> tuple[list[Score], str | None]:
    """Grade the live kernel of one of the lab's own notebooks (``solutions/`` or an untouched
    ``notebooks/`` copy): the pytest plugin's ``grade`` item after nbval, and the browser test
    after JupyterLab ran it. ``run_cell(source)`` executes a cell in that kernel and returns
    when it is idle. Returns the Scores and :func:`lesson_grade_problems`' verdict.

    The answers are collected exactly as the grader collects them and scored with the bank's
    key. An exercise that the notebook's own check cell already scored, on the very function
    the bank's variable holds now, keeps that Score (the same checker from the same bank, run
    minutes ago in that kernel: solutions/08's capstone grading alone takes 40-50 s); any
    other is checked here. Never for a submission: its kernel could report any Score.
    """
    opts = Options()
    bank = bank_for(nb, path, all_banks(opts.banks_path()))
    exercises = {q.id: q.variable for q in bank.questions.values() if q.kind == "exercise"}
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        run_cell(collector_source(bank.names, tmp, bank.pickled))
        collected = read_values(Path(tmp), bank.names)
        run_cell(checked_source(exercises, Path(tmp) / "checked.jsonl"))
        checked = read_scores(Path(tmp) / "checked.jsonl")
    scores = score_bank(bank, collected, opts, trusted=True, checked=checked)
    return scores, lesson_grade_problems(scores, solved)


def lesson_grade_problems(scores: list[Score], solved: bool) -> str | None:
    """Why a lesson notebook's own grade is wrong, or None: a solved notebook must score full
    marks; an untouched student copy zero, and for the right reason (nothing answered, every
    exercise stub "not done"). The pytest plugin and the browser test both hold the lab to it."""
    if solved:
        short = [s for s in scores if s.points < s.max_points]
        return ("a solved notebook must score full marks:\n" + "\n".join(s.text() for s in short)
                if short else None)
    scored = [s for s in scores if s.points > 0 or s.status not in ("unanswered", "not done")]
    return ("an untouched student notebook must score zero, cleanly:\n" +
            "\n".join(s.text() for s in scored) if scored else None)


def submissions_in(target: Path) -> list[Path]:
    """``target`` itself, or every ``*.ipynb`` under a folder (checkpoints skipped), sorted."""
    if target.is_dir():
        return sorted(p for p in target.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    return [target]


def grade_paths(paths: list[str | os.PathLike], opts: Options | None = None,
                progress=None, jobs: int = 1) -> list[dict]:
    """Grade every submission in ``paths`` (files or folders), ``jobs`` at a time.

    Each submission has its own kernel and checker process either way; results (and
    ``progress`` calls) come in submission order.
    """
    subs = [sub for target in map(Path, paths) for sub in submissions_in(target)]
    results = []
    with ThreadPoolExecutor(max(1, min(jobs, len(subs) or 1))) as pool:
        for result in pool.map(lambda sub: grade_notebook(sub, opts), subs):
            results.append(result)
            if progress:
                progress(result)
    return results


# ------------------------------------------------------------- reports
def format_report(result: dict) -> str:
    """A readable report: one line per question, failed exercise cases, troubled cells, notes."""
    head = f"== {result['submission']}"
    if result["status"] != "graded":
        return f"{head}\n   NOT GRADED: {result['error']}"
    lines = [f"{head}  ({result['notebook']}): {result['points']:g} / "
             f"{result['max_points']:g} points"]
    for q in result["questions"]:
        mark = MARKS.get(q["status"], "!")
        lines.append(f"   {mark} {q['id']:<28} {q['points']:g}/{q['max_points']:g}  {q['feedback']}")
        lines += [f"        ✗ {c['name']}" + (f": {c['detail']}" if c["detail"] else "")
                  for c in q["cases"] if not c["passed"]]   # passing cases: counted above
    trouble = [c for c in result["cells"] if c["status"] not in ("ok",)]
    if trouble or result["notes"]:
        lines.append("   Execution:")
        lines += [f"     cell {c['cell']} ({c['first_line']}): {c['status']}"
                  + (f": {c['detail']}" if c["detail"] else "") for c in trouble]
        lines += [f"     {note}" for note in result["notes"]]
    return "\n".join(lines)


def write_csv(results: list[dict], path: str | os.PathLike) -> None:
    """A gradebook: one row per submission, one column per question, then the total."""
    ids: dict[str, None] = {}
    for r in results:
        for q in r["questions"]:
            ids.setdefault(q["id"])
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["submission", "notebook", "status", "points", "max_points", *ids, "error"])
        for r in results:
            got = {q["id"]: f"{q['points']:g}" for q in r["questions"]}
            w.writerow([r["submission"], r["notebook"] or "", r["status"], f"{r['points']:g}",
                        f"{r['max_points']:g}", *(got.get(i, "") for i in ids), r["error"] or ""])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    opts = Options(cell_timeout=args.cell_timeout, notebook_timeout=args.notebook_timeout,
                   check_timeout=args.check_timeout, key_timeout=args.key_timeout,
                   max_restarts=args.max_restarts,
                   bank=args.bank, bank_dir=args.bank_dir)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"error: {missing[0]} does not exist", file=sys.stderr)
        return 2
    try:
        all_banks(opts.banks_path())
    except BankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = open(args.report, "w", encoding="utf-8") if args.report else None

    def show(result: dict) -> None:
        text = format_report(result)
        print(text, flush=True)
        if report:
            report.write(text + "\n")

    try:
        results = grade_paths(args.paths, opts, progress=show, jobs=args.jobs)
    finally:
        if report:
            report.close()
        from ..runtime.launch import shutdown
        shutdown()   # the checkers' ranks
    bad = [r for r in results if r["status"] != "graded"]
    print(f"graded {len(results) - len(bad)} of {len(results)} submission(s)"
          + (f"; {len(bad)} could not be graded" if bad else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"graded_at": _dt.datetime.now().isoformat(timespec="seconds"),
             "bank_dir": str(opts.banks_path()), "submissions": results}, indent=1, default=str))
        print(f"wrote {args.json}")
    csv_path = args.csv or next((Path(p) / "gradebook.csv" for p in args.paths
                                 if Path(p).is_dir()), None)
    if csv_path:
        write_csv(results, csv_path)
        print(f"wrote {csv_path}")
    return 1 if bad else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit grade",
                                description="Grade notebook submissions in fresh kernels.")
    p.add_argument("paths", nargs="+", help="submission .ipynb files or folders of them")
    p.add_argument("--json", help="write per-question points and feedback as JSON here")
    p.add_argument("--csv", help="write a gradebook here (a folder's default: FOLDER/gradebook.csv)")
    p.add_argument("--report", help="also write the text report to this file")
    p.add_argument("--bank", help="grade every submission with this bank, e.g. 03_ring_allreduce")
    p.add_argument("--bank-dir", help="folder of question banks (default: the lab's quizzes/)")
    d = Options()
    p.add_argument("--cell-timeout", type=float, default=d.cell_timeout, help="seconds per cell")
    p.add_argument("--notebook-timeout", type=float, default=d.notebook_timeout,
                   help="seconds per notebook, re-runs included")
    p.add_argument("--check-timeout", type=float, default=d.check_timeout,
                   help="seconds per exercise check")
    p.add_argument("--key-timeout", type=float, default=d.key_timeout,
                   help="seconds per computed key (a question whose answer is computed from "
                        "the notebook's own measurements)")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="re-runs after a cell kills the kernel")
    p.add_argument("--jobs", type=_positive, default=1,
                   help="submissions graded at once, each in its own kernel and checker "
                        "process (default 1; with more jobs than cores, cells and checks "
                        "run slower and reach their time limits sooner)")
    return p


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
