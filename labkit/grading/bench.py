"""Benchmark: what grading one solved notebook costs, and how it fits Gradescope's limits.

``python -m labkit bench grading [LESSON ...]`` grades each lesson's solved notebook with the
lab's grader (``python -m labkit grade``, a fresh kernel, the real checkers) and prints, per
lesson: the wall time, the peak memory of everything the grading started (the sum of the
proportional set size, PSS, of every process carrying the run's mark, sampled every 0.1 s, so
a shorter peak can be missed), how many processes that was, and the limits
:func:`labkit.grading.gradescope.limits` gives for Gradescope's default 10-minute timeout
beside the share of them the run used. Instructors read it to choose an assignment's
autograder settings (CPUs, memory, timeout) before their students find out.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from ..common.tables import Col, table
from .bank import all_banks, bank_dir
from .gradescope import GRADESCOPE_TIMEOUT_S, limits

_MARK = "LABKIT_BENCH_GRADING"


def measure(notebook: Path, bank: str) -> dict:
    """Grade ``notebook`` in a subprocess; its wall time, points and peak memory."""
    mark = uuid.uuid4().hex
    peak = {"pss": 0, "procs": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pss = n = 0
            for p in psutil.process_iter():
                try:
                    if p.environ().get(_MARK) == mark:
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
    out = subprocess.run([sys.executable, "-m", "labkit", "grade", str(notebook), "--bank", bank],
                         capture_output=True, text=True, env={**os.environ, _MARK: mark})
    wall = time.monotonic() - t0
    done.set()
    sampler.join()
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("== ")), "")
    points = line.rsplit(":", 1)[-1].strip() if out.returncode == 0 else f"exit {out.returncode}"
    return {"wall_s": wall, "pss_mib": peak["pss"] / 2 ** 20, "procs": peak["procs"],
            "points": points}


COLUMNS = [Col("lesson", "lesson", "<30"), Col("points", "points", ">16"),
           Col("wall s", "wall_s", ">7.1f"), Col("peak PSS MiB", "pss_mib", ">13.0f"),
           Col("procs", "procs", ">6"), Col("notebook limit s", "notebook_s", ">17.0f"),
           Col("used", lambda r: f"{r['wall_s'] / r['notebook_s']:.0%}", ">5"),
           Col("check limit s", "check_s", ">14")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit bench grading",
                                description="grading time and peak memory per lesson, beside "
                                            "the Gradescope limits")
    p.add_argument("lessons", nargs="*", help="bank names or numbers (default: every lesson)")
    a = p.parse_args(argv)
    banks = all_banks(bank_dir())
    chosen = [b for b in banks.values()
              if not a.lessons or b.name in a.lessons or b.prefix in a.lessons]
    repo = Path(__file__).resolve().parents[2]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"python -m labkit bench grading: {time.strftime('%Y-%m-%d %H:%M')}, {cores} usable "
          f"cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    rows = []
    for bank in chosen:
        lim = limits(bank, GRADESCOPE_TIMEOUT_S)
        row = measure(repo / "solutions" / f"{bank.name}.ipynb", bank.name)
        exercises = any(q.kind == "exercise" for q in bank.questions.values())
        rows.append({"lesson": bank.name, "notebook_s": lim["notebook_timeout"],
                     "check_s": f"{lim['check_timeout']:.0f}" if exercises else "-", **row})
        print(f"  {bank.name}: {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(table(COLUMNS, rows, above=[
        "the solved notebook graded by `python -m labkit grade` (kernel, collection, checks);",
        "peak PSS: every process of the grading, sampled every 0.1 s; limits: those of",
        f"`python -m labkit gradescope LESSON` for Gradescope's default {GRADESCOPE_TIMEOUT_S} s "
        "timeout (used: wall / notebook limit)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
