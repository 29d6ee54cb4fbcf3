"""Benchmark: what grading one solved notebook costs, under the limits of its Gradescope zip.

``python -m labkit bench grading [LESSON ...] [--timeout S]`` grades each lesson's solved
notebook with the lab's grader (``python -m labkit grade``: a fresh kernel, the real checkers)
under the limits :func:`labkit.grading.gradescope.limits` gives for a Gradescope timeout of
``--timeout`` seconds (default 600, Gradescope's default), and prints per lesson: the points it
got under those limits (a check that ran past its limit loses its points here, as it would on
Gradescope), the wall time, the peak memory of everything the grading started (the sum of the
proportional set size, PSS, of every process carrying the run's mark, sampled every 0.1 s, so a
shorter peak can be missed), how many processes that was, and the limits. Instructors read it
to choose an assignment's autograder settings (CPUs, memory, timeout).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from ..common.tables import Col, table
from ..runtime import procs
from .bank import all_banks, bank_dir
from .gradescope import GRADESCOPE_TIMEOUT_S, lesson_bank, limits

def measure(notebook: Path, args: list[str]) -> dict:
    """Grade ``notebook`` in a subprocess (``args``: the grader's options); its wall time,
    points and peak memory over every process of its tree."""
    tree = procs.Tree("grading benchmark")
    peak = {"pss": 0, "procs": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pss = n = 0
            for p in tree.live():
                try:
                    pss += p.memory_full_info().pss
                    n += 1
                except (psutil.Error, OSError):
                    pass
            if pss > peak["pss"]:
                peak.update(pss=pss, procs=n)
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    sampler.start()
    try:
        proc = tree.start([sys.executable, "-m", "labkit", "grade", str(notebook), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stdout, _ = proc.communicate(timeout=3600)
        code = proc.returncode
    finally:
        done.set()
        tree.stop()
    wall = time.monotonic() - t0
    sampler.join()
    line = next((ln for ln in stdout.splitlines() if ln.startswith("== ")), "")
    points = line.rsplit(":", 1)[-1].strip() if code == 0 else f"exit {code}"
    return {"wall_s": wall, "pss_mib": peak["pss"] / 2 ** 20, "procs": peak["procs"],
            "points": points}


COLUMNS = [Col("lesson", "lesson", "<30"), Col("points", "points", ">16"),
           Col("wall s", "wall_s", ">7.1f"), Col("peak PSS MiB", "pss_mib", ">13.0f"),
           Col("procs", "procs", ">6"), Col("notebook limit s", "notebook_s", ">17.0f"),
           Col("check limit s", "check_s", ">14")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit bench grading",
                                description="grading time and peak memory per lesson, beside "
                                            "the Gradescope limits")
    p.add_argument("lessons", nargs="*", help="bank names or numbers (default: every lesson)")
    p.add_argument("--timeout", type=float, default=GRADESCOPE_TIMEOUT_S,
                   help="the Gradescope timeout whose limits to grade under (default 600)")
    a = p.parse_args(argv)
    try:
        chosen = ([lesson_bank(x) for x in a.lessons] if a.lessons
                  else list(all_banks(bank_dir()).values()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"python -m labkit bench grading: {time.strftime('%Y-%m-%d %H:%M')}, {cores} usable "
          f"cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    rows = []
    for bank in chosen:
        lim = limits(bank, a.timeout)
        args = ["--bank", bank.name, "--cell-timeout", f"{lim['cell_timeout']:g}",
                "--notebook-timeout", f"{lim['notebook_timeout']:g}",
                "--check-timeout", f"{lim['check_timeout']:g}",
                "--key-timeout", f"{lim['key_timeout']:g}"]
        row = measure(repo / "solutions" / f"{bank.name}.ipynb", args)
        exercises = any(q.kind == "exercise" for q in bank.questions.values())
        rows.append({"lesson": bank.name, "notebook_s": lim["notebook_timeout"],
                     "check_s": f"{lim['check_timeout']:.0f}" if exercises else "-", **row})
        print(f"  {bank.name}: {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(table(COLUMNS, rows, above=[
        "the solved notebook graded by `python -m labkit grade` (kernel, collection, checks)",
        f"under the limits of `python -m labkit gradescope LESSON --timeout {a.timeout:g}`;",
        "peak PSS: every process of the grading, sampled every 0.1 s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
