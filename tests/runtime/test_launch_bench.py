"""The launch benchmark's method (labkit.runtime.bench): order alternates, one clock, honest
cells. Timings are printed by the command, never asserted here."""
from __future__ import annotations

import subprocess

import pytest

from labkit.runtime import bench


def test_runs_alternate_the_launchers_order_and_kernel_modes_skip_spawn(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "installed", lambda lc: lc in ("lk.run", "mp.spawn", "fork"))
    monkeypatch.setattr(bench, "_once", lambda script, lc, mode, job, n, settle, jobs:
                        calls.append((mode, lc)) or 1.0)
    rows = bench.measure(4, repeat=2)
    cold = [lc for mode, lc in calls if mode == "cold"][:6]
    assert cold == ["lk.run", "mp.spawn", "fork", "fork", "mp.spawn", "lk.run"]
    kernel = {lc for mode, lc in calls if mode == "kernel"}
    assert kernel == {"lk.run", "fork"}          # mp.spawn cannot run a notebook's function
    assert [r["mode"] for r in rows] == list(bench.MODES)


def test_table_shows_median_spread_missing_cells_and_the_ratio_to_the_best_peer(monkeypatch):
    monkeypatch.setattr(bench, "installed", lambda lc: lc != "ipyparallel")
    rows = [{"ranks": 4, "mode": "repeated",
             "times": {"lk.run": [0.004, 0.002, 0.003], "fork": [0.12], "accelerate": [0.2]}}]
    text = bench.launch_table(rows, 3, 5, 5)
    assert "0.0030 (0.0020-0.0040)" in text and "0.03x" in text  # 0.003 / 0.12 (fork, best)
    assert "ipyparallel: not installed" in text and "ipyparallel s" not in text
    line = text.splitlines()[-1]
    assert line.split()[4] == "-"                                # mp.spawn's cell


def test_a_run_that_hangs_or_fails_costs_its_run_and_is_reported_not_the_table(monkeypatch):
    monkeypatch.setattr(bench, "installed", lambda lc: lc in ("lk.run", "mp.spawn", "fork",
                                                              "accelerate"))
    monkeypatch.setattr(bench, "RUN_LIMIT_S", 0.5)
    monkeypatch.setattr(bench.procs, "run", fake_run := _FakeRun())
    rows = bench.measure(4, repeat=2, settle=5.0)
    assert fake_run.killed_after == [5.5] * 2          # accelerate's kernel runs: limit + settle
    repeated = rows[-1]
    assert repeated["times"]["accelerate"] == [] and len(repeated["times"]["fork"]) == 2
    assert repeated["failed"]["accelerate"][0] == "exit status 1: RuntimeError: launcher broke"
    assert rows[1]["failed"]["mp.spawn"] == ["exit status 1"] * 2
    text = bench.launch_table(rows, 2, 5, 5)
    assert ("4 ranks, first in a kernel, accelerate: 2 of 2 runs failed, left out of its cell "
            "(no end within 5.5 s (stopped))") in text
    assert "4 ranks, repeated, accelerate: 2 of 2 runs failed" in text
    kernel = next(ln for ln in text.splitlines() if " first in a kernel " in ln)
    cells = kernel.split()
    assert cells[-2] == "-" and cells[-1] == "0.50x"         # accelerate's cell; lk 0.1 / fork 0.2
    ddp = next(ln for ln in text.splitlines() if " cold, DDP " in ln)
    assert ddp.split()[5] == "-"          # ranks, mode (2), lk's cell (2), then mp.spawn's: all failed


def test_a_run_that_prints_no_time_fails_that_run_by_name(monkeypatch):
    monkeypatch.setattr(bench.procs, "run", lambda what, argv, timeout, **kw: (0, "\n", ""))
    with pytest.raises(bench.RunFailed, match="printed no time"):
        bench._once("script.py", "fork", "repeat", "trivial", 4, 5.0, 5)


class _FakeRun:
    """procs.run as the launchers answer: accelerate hangs in the kernel mode and raises when
    repeated, mp.spawn's cold DDP exits 1 with nothing on stderr; lk takes 0.1 s, fork 0.2 s."""

    def __init__(self):
        self.killed_after = []

    def __call__(self, what, argv, timeout, **popen):
        launcher, mode, job = argv[2], argv[3], argv[4]
        if launcher == "accelerate" and mode == "kernel":
            self.killed_after.append(timeout)
            raise subprocess.TimeoutExpired(argv, timeout)
        if launcher == "accelerate" and mode == "repeat":
            return 1, "", "Traceback ...\nRuntimeError: launcher broke\n"
        if launcher == "mp.spawn" and job == "ddp":
            return 1, "", ""
        return 0, "0.1\n" if launcher == "lk.run" else "0.2\n", ""
