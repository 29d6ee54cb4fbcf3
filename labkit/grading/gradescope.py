"""Grading on Gradescope: the lab's own grader packed as a Gradescope autograder.

::

    python -m labkit gradescope 03_ring_allreduce              # -> gradescope_03_ring_allreduce.zip
    python -m labkit gradescope 03 --timeout 1200 --out ag.zip # after raising the assignment's timeout

The zip follows Gradescope's documented autograder layout and results format
(https://gradescope-autograders.readthedocs.io/en/latest/specs/): Gradescope unpacks it into
``/autograder/source``, runs ``setup.sh`` once as root when it builds the image, then, for every
submission, ``run_autograder`` with the student's upload in ``/autograder/submission`` and
reads ``/autograder/results/results.json``. In the zip:

``setup.sh``
    Installs Python (apt, when the image has none of 3.11 or newer), a virtual environment in
    ``source/.venv``, torch from PyTorch's CPU index and the lab's pinned requirements (less the
    browser and test tools). Grading downloads nothing.
``run_autograder``
    Runs :func:`run`: grades the one ``.ipynb`` of the submission with the lab's grader
    (:mod:`labkit.grading.grader`: a fresh kernel, the bank's key and real multi-process
    checkers) and writes ``results.json``, whatever the submission is or does.
``autograder.json``
    The lesson and the grading limits (:func:`limits`), fixed when the zip is built.
``labkit/``, ``quizzes/NN_name.toml``, ``pyproject.toml``, ``requirements.txt``
    The lab itself (imported from ``source/`` through ``PYTHONPATH``) and its one bank.

What a student sees: one test per quiz question and one per case of each exercise, each with
its points and the checker's message, and a summary of how the notebook ran. Never the key: a
wrong answer shows what was answered and the bank's hint; the explanation (which states the
answer) only once the answer is right.

Always a ``results.json``: a submission that cannot be graded (no notebook, several, empty,
truncated, not JSON) gets a score of 0 and a message that says why and what to upload; so does
a grading that crashed or ran past the assignment's time limit (a watchdog ends it
:data:`HARNESS_MARGIN_S` seconds before Gradescope would). The grading runs in a process tree
of its own (:class:`labkit.runtime.procs.Tree`) that is stopped before ``results.json`` is
written, so no process the submission started and left running rewrites the results. What
this does not stop (the README says more): on Gradescope the submission's code runs as root and
the exercise checks run it in the checker process, so code written to attack the grading can
rewrite the lab's files or the checker's report while it runs, or escape the sweep by scrubbing
its environment; scores the checker reports must at least be possible ones
(:func:`labkit.grading.sandbox.score_in_sandbox`).

For tests, ``LABKIT_AUTOGRADER_ROOT`` moves ``/autograder`` and ``LABKIT_PYTHON`` makes
``setup.sh`` use an existing environment instead of making one.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .bank import Bank, BankError, all_banks, bank_dir, load_bank
from .score import MARKS

__all__ = ["GRADESCOPE_TIMEOUT_S", "HARNESS_MARGIN_S", "VISIBILITIES", "limits", "worst_case_s",
           "build", "lesson_bank", "run", "results_from_grade", "failure", "find_submission", "main"]

GRADESCOPE_TIMEOUT_S = 600   # Gradescope's default autograder timeout: 10 minutes
GRADESCOPE_MAX_S = 2400      # the most an assignment can be given: 40 minutes
HARNESS_MARGIN_S = 40        # the watchdog ends grading this long before Gradescope's timeout:
                             # its own sweep of the grading's processes, and writing the results
VISIBILITIES = ("visible", "after_due_date", "after_published", "hidden")
CONFIG = "autograder.json"
ROOT_ENV = "LABKIT_AUTOGRADER_ROOT"

# What one grading spends besides the notebook's cells and the exercise checks (seconds).
_COLLECT_S = 30.0      # collecting the answers from the kernel
_GRACE_S = 5.0         # an interrupted cell (or collection) ignoring the interrupt, before the kill
_STOP_S = 15.0         # the kernel shut down and its tree swept
_RUNNER_S = 10.0       # the runner and the grader started, the results written
_KEY_S = 15.0          # a computed key: a sum or a product of the notebook's own numbers
_CHECK_MAX_S = 300.0   # the grader's default per exercise check
_CELL_MAX_S = 120.0    # the grader's default per cell

# In the zip: everything the lab needs to grade, nothing only its tests and JupyterLab need.
_NOT_FOR_GRADING = ("jupyterlab", "playwright", "pytest", "pytest-timeout", "pytest-xdist",
                    "nbval")


# ------------------------------------------------------------------------------ limits
def _fixed_s(bank: Bank) -> tuple[float, int]:
    """The seconds a grading of ``bank`` may spend outside the notebook's own time and the
    exercise checks, as :func:`worst_case_s` counts them; and the number of exercises."""
    exercises = sum(q.kind == "exercise" for q in bank.questions.values())
    no_checks = {"notebook_timeout": 0.0, "check_timeout": 0.0, "key_timeout": _KEY_S,
                 "collect_timeout": _COLLECT_S, "grace": _GRACE_S}
    return worst_case_s(bank, no_checks) + HARNESS_MARGIN_S, exercises


def limits(bank: Bank, timeout_s: float = GRADESCOPE_TIMEOUT_S) -> dict[str, float]:
    """The grader's limits for ``bank`` so that a whole grading, at its worst
    (:func:`worst_case_s`), ends :data:`HARNESS_MARGIN_S` before Gradescope's ``timeout_s``.
    After the fixed costs the time left is split: the exercise checks share half (each at most
    the grader's default 300 s) and the notebook gets the rest; no cell more than 120 s.

    Raises ValueError when ``timeout_s`` leaves the notebook less than a minute."""
    fixed, exercises = _fixed_s(bank)
    left = timeout_s - fixed
    check = min(_CHECK_MAX_S, left / 2 / exercises) if exercises else _CHECK_MAX_S
    notebook = left - exercises * check
    if notebook < 60:
        least = fixed + (120 if exercises else 60)
        raise ValueError(f"a {timeout_s:g} s autograder timeout leaves {max(notebook, 0):.0f} s "
                         f"for running {bank.name} ({exercises} exercise(s)); give it at least "
                         f"{least:.0f} s")
    return {"cell_timeout": min(_CELL_MAX_S, notebook), "notebook_timeout": notebook,
            "check_timeout": check, "key_timeout": _KEY_S, "collect_timeout": _COLLECT_S,
            "max_restarts": 2, "grace": _GRACE_S}


def worst_case_s(bank: Bank, lim: dict[str, float]) -> float:
    """The longest a grading with limits ``lim`` can take, from the limits each part of the
    grader keeps: the notebook's time (re-runs included), a kernel start begun just before that
    ran out, a cell ignoring its interrupt, collecting (and ignoring that interrupt too),
    stopping the kernel, the checker process at its own limit, and the runner."""
    from .kernel import KERNEL_START_S
    from .sandbox import START_S

    remote = [q for q in bank.questions.values() if q.runs_submission_code]
    sandbox = (START_S + sum(lim["check_timeout"] if q.kind == "exercise" else lim["key_timeout"]
                             for q in remote)) if remote else 0.0
    return (lim["notebook_timeout"] + KERNEL_START_S + lim["grace"] + lim["collect_timeout"]
            + lim["grace"] + _STOP_S + sandbox + _RUNNER_S)


# ------------------------------------------------------------------------------ build
_SETUP = r'''#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image (an Ubuntu image).
# It installs Python, then torch and the lab's pinned requirements into source/.venv; grading
# itself downloads nothing. Built by `python -m labkit gradescope {bank}`.
#   LABKIT_PYTHON=/path/to/python   install into that interpreter's environment instead (the
#                                   lab's tests point it at theirs, where all is installed)
set -euo pipefail
cd "$(dirname "$0")"
if [ -n "${{LABKIT_PYTHON:-}}" ]; then
    PYTHON=$LABKIT_PYTHON
else
    # Python 3.11 or newer with venv (the lab reads its banks with tomllib): Ubuntu 24.04 has
    # 3.12; on 22.04 (3.10) try apt's python3.11 beside it
    ok() {{ command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }}
    PY=""
    for c in python3 python3.13 python3.12 python3.11; do if ok "$c"; then PY=$c; break; fi; done
    if [ -z "$PY" ]; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv python3-pip
        for c in python3 python3.11; do if ok "$c"; then PY=$c; break; fi; done
    fi
    if [ -z "$PY" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3.11 python3.11-venv || true
        if ok python3.11; then PY=python3.11; fi
    fi
    if [ -z "$PY" ]; then
        echo "setup.sh: the lab needs Python 3.11 or newer with venv, and none could be installed" >&2
        echo "here ($(python3 --version 2>&1)). Choose the Ubuntu 24.04 base image in the" >&2
        echo "assignment's autograder settings." >&2
        exit 1
    fi
    "$PY" -m venv .venv
    PYTHON=$PWD/.venv/bin/python
fi
# torch {torch} from PyTorch's CPU index: the default index's Linux wheel is the CUDA build (GBs)
if ! "$PYTHON" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "{torch}")' 2>/dev/null; then
    "$PYTHON" -m pip install --disable-pip-version-check "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu
fi
"$PYTHON" -m pip install --disable-pip-version-check -r requirements.txt
PYTHONPATH=$PWD "$PYTHON" -m labkit.grading.gradescope check
printf '%s\n' "$PYTHON" > .python
'''

_RUN = r'''#!/usr/bin/env bash
# Gradescope runs this for every submission: it grades the one notebook in submission/ with
# the lab's grader and writes results/results.json, whatever the submission is or does.
ROOT=${{{root_env}:-/autograder}}
SRC=$ROOT/source
PYTHON=$(cat "$SRC/.python" 2>/dev/null || echo python3)
export PYTHONPATH=$SRC
mkdir -p "$ROOT/results"
"$PYTHON" -m labkit.grading.gradescope run --root "$ROOT"
code=$?
if [ $code -ne 0 ]; then   # Python itself could not run the grader: still say so to the student
    printf '%s\n' '{{"score": 0, "execution_time": '$SECONDS', "stdout_visibility": "hidden", "tests": [], "output": "The autograder could not start (exit code '$code'), so this submission was not graded. This is not a problem with your notebook: tell your instructor."}}' > "$ROOT/results/results.json"
fi
exit 0
'''


def build(lesson: str, out: str | os.PathLike | None = None,
          timeout_s: float = GRADESCOPE_TIMEOUT_S, visibility: str = "visible",
          cell_timeout: float | None = None) -> Path:
    """Write the autograder zip of ``lesson`` (a bank name or its number) and return its path.

    ``timeout_s`` is the assignment's autograder timeout on Gradescope (its default, 600 s,
    unless you raised it); ``visibility`` is each test's; ``cell_timeout`` caps the per-cell
    limit below what :func:`limits` gives."""
    if visibility not in VISIBILITIES:
        raise ValueError(f"visibility must be one of {', '.join(VISIBILITIES)}, not {visibility!r}")
    if not 0 < timeout_s <= GRADESCOPE_MAX_S:
        raise ValueError(f"--timeout {timeout_s:g}: Gradescope allows an autograder 1 to "
                         f"{GRADESCOPE_MAX_S} s (40 minutes)")
    if cell_timeout is not None and cell_timeout <= 0:
        raise ValueError(f"--cell-timeout {cell_timeout:g}: must be more than 0 s")
    bank = lesson_bank(lesson)
    lim = limits(bank, timeout_s)
    if cell_timeout is not None:
        lim["cell_timeout"] = min(lim["cell_timeout"], float(cell_timeout))
    repo = Path(__file__).resolve().parents[2]
    out = Path(out) if out else Path(f"gradescope_{bank.name}.zip")
    config = {"bank": bank.name, "timeout_s": timeout_s, "visibility": visibility,
              "limits": lim, "built": _dt.datetime.now().isoformat(timespec="seconds"),
              "lab_commit": repo_commit(repo)}
    torch = _pin(repo / "requirements.txt", "torch")
    files: dict[str, bytes] = {
        "setup.sh": _SETUP.format(bank=bank.name, torch=torch).encode(),
        "run_autograder": _RUN.format(root_env=ROOT_ENV).encode(),
        CONFIG: (json.dumps(config, indent=1) + "\n").encode(),
        "requirements.txt": _grading_requirements(repo / "requirements.txt").encode(),
        "pyproject.toml": (repo / "pyproject.toml").read_bytes(),
        f"quizzes/{bank.path.name}": bank.path.read_bytes(),
    }
    for path in sorted((repo / "labkit").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files[path.relative_to(repo).as_posix()] = path.read_bytes()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name in ("setup.sh", "run_autograder") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    tmp.replace(out)
    return out


def lesson_bank(lesson: str) -> Bank:
    """The bank of ``lesson``: its name (``03_ring_allreduce``, a file name too) or number."""
    banks = all_banks(bank_dir())
    name = Path(lesson).stem
    matches = [b for b in banks.values() if name in (b.name, b.prefix)]
    if len(matches) != 1:
        raise ValueError(f"no lesson {lesson!r}: name one of {', '.join(banks)} (or its number)")
    return matches[0]


def _pin(requirements: Path, package: str) -> str:
    for line in requirements.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower() == package:
            return version.strip()
    raise ValueError(f"{requirements} pins no {package}")


def _grading_requirements(requirements: Path) -> str:
    """The lab's requirements, pins kept, less the browser and test tools and the editable
    install of the lab (``run_autograder`` imports it from ``source/``)."""
    keep = ["# The lab's pinned requirements for grading (from its requirements.txt): less the",
            "# browser and test tools; labkit itself is imported from /autograder/source."]
    for line in requirements.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if not spec or spec.startswith("-e"):
            continue
        if spec.split("==")[0].strip().lower() not in _NOT_FOR_GRADING:
            keep.append(spec)
    return "\n".join(keep) + "\n"


def repo_commit(repo: Path) -> str | None:
    """``repo``'s checked-out commit (HEAD), in full; None outside a git checkout or without git
    (also the executed copies' header: :mod:`labkit.grading.pytest_plugin`)."""
    from ..runtime import procs

    try:
        code, out, _ = procs.run("git", ["git", "-C", str(repo), "rev-parse", "HEAD"], 10,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.strip() or None) if code == 0 else None


# ------------------------------------------------------------------------------ run
def run(root: str | os.PathLike | None = None) -> int:
    """Grade the submission under ``root`` (default ``$LABKIT_AUTOGRADER_ROOT`` or
    ``/autograder``) and write ``root/results/results.json``. Never raises; returns 0."""
    t0 = time.monotonic()
    root = Path(root or os.environ.get(ROOT_ENV) or "/autograder")
    target = root / "results" / "results.json"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        results = _grade_submission(root, t0)
    except BaseException as exc:  # noqa: BLE001  (never Gradescope's generic failure)
        print(f"the autograder failed: {type(exc).__name__}: {exc}", flush=True)
        results = failure("The autograder itself failed, so this submission was not graded. "
                          "This is not a problem with your notebook: tell your instructor.")
    results["execution_time"] = round(time.monotonic() - t0)
    tmp = target.with_name(f".results.{os.getpid()}.json")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(target)
    print(f"wrote {target}: {results['score']:g} points", flush=True)
    return 0


def failure(message: str, max_points: float | None = None) -> dict:
    """The results of a submission that could not be graded: a score of 0 and why (shown at
    once whatever the tests' visibility: the student can fix it and submit again)."""
    out = {"score": 0.0, "output": message, "visibility": "visible",
           "stdout_visibility": "hidden", "tests": []}
    if max_points is not None:
        out["output"] += f"\n\nScore: 0 / {max_points:g}."
    return out


def find_submission(folder: Path, bank: Bank) -> tuple[Path | None, str | None]:
    """The one notebook in the submission ``folder``, or None and a message for the student."""
    want = f"{bank.name}.ipynb"
    if not folder.is_dir():
        return None, f"No submission folder was found, so nothing was graded. Upload {want}."
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not _hidden(p, folder))
    notebooks = [p for p in files if p.suffix == ".ipynb"]
    if len(notebooks) == 1:
        return notebooks[0], None
    seen = ", ".join(p.relative_to(folder).as_posix() for p in files[:10]) or "no files at all"
    if not notebooks:
        return None, (f"Your submission has no notebook (.ipynb file), so nothing was graded; it "
                      f"has {seen}{' ...' if len(files) > 10 else ''}. Upload your {want} "
                      f"(in Jupyter: File > Download) and submit again.")
    names = ", ".join(p.relative_to(folder).as_posix() for p in notebooks)
    return None, (f"Your submission has {len(notebooks)} notebooks ({names}), and the autograder "
                  f"grades exactly one, so nothing was graded. Submit only your {want}.")


def _hidden(path: Path, folder: Path) -> bool:
    parts = path.relative_to(folder).parts
    return any(p.startswith(".") or p == "__MACOSX" for p in parts)


def _grade_submission(root: Path, t0: float) -> dict:
    from ..runtime.procs import Tree

    source = root / "source"
    config, bank = _unpacked(source)
    nb, problem = find_submission(root / "submission", bank)
    if nb is None:
        return failure(problem, bank.max_points)
    deadline = t0 + config["timeout_s"] - HARNESS_MARGIN_S
    print(f"grading {nb} as {bank.name} with labkit from {Path(__file__).parents[2]}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="labkit-gradescope-"))
    tree = Tree("Gradescope grading")
    try:
        out = work / "grade.json"
        proc = tree.start([sys.executable, "-m", "labkit.grading.gradescope", "grade", str(nb),
                           "--source", str(source), "--out", str(out)],
                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return failure(f"Grading ran past the assignment's time limit "
                           f"({config['timeout_s']:g} s) and was stopped, so it has no score. "
                           f"Does a cell of your notebook run for a long time, or wait forever "
                           f"(a deadlock between ranks)? Fix it, run the notebook from the top "
                           f"in Jupyter (Kernel > Restart and Run All), and submit again.",
                           bank.max_points)
        tree.stop()   # whatever the submission started and left running: before any result
        if proc.returncode != 0 or not out.exists():
            return failure(f"The grader stopped (exit code {proc.returncode}) before it finished, "
                           f"so this submission was not graded. This is not a problem with your "
                           f"notebook: tell your instructor.", bank.max_points)
        grade = json.loads(out.read_text())
    finally:
        tree.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(grade.pop("report", ""), flush=True)   # for the instructor (stdout is not shown)
    return results_from_grade(grade, bank, config["visibility"])


def _unpacked(source: Path) -> tuple[dict, Bank]:
    """The unpacked zip's config and the bank it names."""
    config = json.loads((source / CONFIG).read_text())
    return config, load_bank(source / "quizzes" / f"{config['bank']}.toml")


def _grade_child(nb: Path, source: Path, out: Path) -> int:
    """The grading itself, in its own process (what :func:`_grade_submission` starts)."""
    from ..runtime.launch import shutdown
    from .grader import Options, format_report, grade_notebook

    config = json.loads((source / CONFIG).read_text())
    opts = Options(**config["limits"], bank=config["bank"], bank_dir=str(source / "quizzes"))
    try:
        result = grade_notebook(nb, opts)
    finally:
        shutdown()   # the checkers' ranks
    result["claimed"] = _claimed_lesson(nb)
    result["report"] = format_report(result)
    out.write_text(json.dumps(result, default=str))
    return 0


def _claimed_lesson(nb: Path) -> str | None:
    try:
        meta = json.loads(nb.read_text(encoding="utf-8")).get("metadata", {}).get("labkit", {})
        return meta.get("bank") if isinstance(meta.get("bank"), str) else None
    except Exception:  # noqa: BLE001  (an unreadable notebook was reported by the grader)
        return None


# ------------------------------------------------------------------------------ results
def results_from_grade(grade: dict, bank: Bank, visibility: str = "visible") -> dict:
    """Gradescope's ``results.json`` from one :func:`labkit.grading.grader.grade_notebook`
    result: one test per quiz question and per exercise case, the overall score, a summary."""
    if grade["status"] != "graded":
        return failure(f"Your notebook could not be graded: {grade['error']}.", bank.max_points)
    tests: list[dict] = []
    for q in grade["questions"]:
        question = bank.questions[q["id"]]
        if q["kind"] == "exercise" and q["cases"]:
            tests += _case_tests(q, question, visibility)
        else:
            tests.append(_test(q["id"], q["points"], q["max_points"], q["status"] == "correct",
                               _quiz_output(q, question), visibility))
    for i, t in enumerate(tests, 1):
        t["number"] = str(i)
    return {"score": grade["points"], "output": _summary(grade, bank, visibility),
            "output_format": "text", "visibility": visibility, "stdout_visibility": "hidden",
            "tests": tests}


def _test(name: str, score: float, max_score: float, passed: bool, output: str,
          visibility: str) -> dict:
    return {"name": name, "score": round(score, 6), "max_score": round(max_score, 6),
            "status": "passed" if passed else "failed", "output": output,
            "output_format": "text", "visibility": visibility}


def _quiz_output(q: dict, question) -> str:
    lines = [question.prompt, "", f"{MARKS.get(q['status'], '!')} {q['feedback']}"]
    if q["status"] == "correct":
        if q.get("answer"):
            lines.append(f"You answered: {q['answer']}")
        if q.get("explanation"):   # it states the answer: shown only to who found it
            lines.append(f"Why: {q['explanation']}")
    return "\n".join(lines)


def _case_tests(q: dict, question, visibility: str) -> list[dict]:
    cases = q["cases"]
    share = q["max_points"] / len(cases)
    credited = q["points"] > 0          # partial credit, or every case passed
    head = f"{q['id']}: {q['feedback']} ({q['points']:g}/{q['max_points']:g} points)"
    if not question.partial and not credited:
        head += "; this exercise scores only when every case passes"
    tests = []
    for c in cases:
        lines = [f"{'✓ passed' if c['passed'] else '✗ failed'}"
                 + (f": {c['detail']}" if c["detail"] else ""), "", head, question.prompt]
        if c is cases[0] and q["status"] == "correct" and q.get("explanation"):
            lines.append(f"Why: {q['explanation']}")
        tests.append(_test(f"{q['id']} · {c['name']}", share if c["passed"] and credited else 0.0,
                           share, c["passed"], "\n".join(lines), visibility))
    return tests


def _summary(grade: dict, bank: Bank, visibility: str) -> str:
    lines = [f"{bank.name}: {grade['points']:g} / {grade['max_points']:g} points."
             if visibility == "visible" else f"{bank.name}: graded.",
             "Your notebook ran from the top in a fresh kernel; the answer variables and "
             "functions it defined were then read and checked by the lab's grader (with its own "
             "key, and exercises on real ranks). Printed output and check cells are not read."]
    claimed = grade.get("claimed")
    if claimed and claimed != bank.name:
        lines.insert(0, f"This notebook is lesson {claimed}, but this assignment grades "
                        f"{bank.name}: did you upload the right notebook?\n")
    trouble = [c for c in grade["cells"] if c["status"] != "ok"]
    if trouble:
        lines += ["", "Cells that did not finish cleanly (answers they define may be missing):"]
        lines += [f"  cell {c['cell']} ({c['first_line']}): {c['status']}"
                  + (f": {c['detail']}" if c["detail"] else "") for c in trouble]
    if grade["notes"]:
        lines += ["", *grade["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ commands
def _check(source: Path) -> int:
    """setup.sh's last step: the bank loads and everything grading imports is installed."""
    import matplotlib
    import nbclient  # noqa: F401
    import torch
    from jupyter_client.kernelspec import KernelSpecManager

    from . import grader  # noqa: F401

    config, bank = _unpacked(source)
    KernelSpecManager().get_kernel_spec("python3")
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        reply = kc.execute_interactive("import labkit, torch", timeout=120)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"a kernel cannot import the lab: {reply['content']}")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (builds the font cache now, not in every grading)
    print(f"ready to grade {bank.name} ({bank.max_points:g} points) with torch "
          f"{torch.__version__}; limits: {config['limits']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        p = argparse.ArgumentParser(prog="run_autograder")
        p.add_argument("--root")
        return run(p.parse_args(argv[1:]).root)
    if argv[:1] == ["grade"]:
        p = argparse.ArgumentParser(prog="gradescope grade")
        p.add_argument("notebook", type=Path)
        p.add_argument("--source", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        a = p.parse_args(argv[1:])
        return _grade_child(a.notebook, a.source, a.out)
    if argv[:1] == ["check"]:
        return _check(Path.cwd())
    args = _parser().parse_args(argv)
    try:
        out = build(args.lesson, args.out, args.timeout, args.visibility, args.cell_timeout)
    except (ValueError, BankError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = json.loads(zipfile.ZipFile(out).read(CONFIG))
    lim = config["limits"]
    print(f"wrote {out}: the autograder of {config['bank']}, for a {config['timeout_s']:g} s "
          f"Gradescope timeout\n  limits: {lim['cell_timeout']:.0f} s per cell, "
          f"{lim['notebook_timeout']:.0f} s per notebook (re-runs included), "
          f"{lim['check_timeout']:.0f} s per exercise check, {lim['key_timeout']:.0f} s per "
          f"computed key\nUpload it under the assignment's Configure Autograder (zip file "
          f"upload); see the README's instructor section for the settings it needs.")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit gradescope",
        description="Build a Gradescope autograder zip that grades one lesson's notebook with "
                    "the lab's grader.")
    p.add_argument("lesson", help="the lesson: its bank name (03_ring_allreduce) or number (03)")
    p.add_argument("--out", help="the zip to write (default: gradescope_LESSON.zip)")
    p.add_argument("--timeout", type=float, default=GRADESCOPE_TIMEOUT_S,
                   help="the assignment's autograder timeout on Gradescope, in seconds "
                        "(default 600: Gradescope's default; at most 2400); the grading limits "
                        "are set so that grading ends before it")
    p.add_argument("--visibility", choices=VISIBILITIES, default="visible",
                   help="when students see each test's result (default: visible)")
    p.add_argument("--cell-timeout", type=float,
                   help="a lower per-cell limit than the one the timeout gives")
    return p


if __name__ == "__main__":
    sys.exit(main())
