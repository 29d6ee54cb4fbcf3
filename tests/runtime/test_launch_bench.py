"""The launch benchmark's method (labkit.runtime.bench): order alternates, one clock, honest
cells. Timings are printed by the command, never asserted here."""
from __future__ import annotations

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
    monkeypatch.setattr(bench, "installed", lambda lc: lc in ("lk.run", "fork", "accelerate"))
    monkeypatch.setattr(bench, "RUN_LIMIT_S", 0.5)
    monkeypatch.setattr(bench.procs, "run", fake_run := _FakeRun())
    rows = bench.measure(4, repeat=2)
    assert fake_run.killed_after == [0.5] * 2                  # accelerate's kernel-mode runs
    repeated = rows[-1]
    assert repeated["times"]["accelerate"] == [] and len(repeated["times"]["fork"]) == 2
    assert repeated["failed"]["accelerate"][0] == "exit status 1: RuntimeError: launcher broke"
    text = bench.launch_table(rows, 2, 5, 5)
    assert ("4 ranks, first in a kernel, accelerate: 2 of 2 runs failed, left out of its cell "
            "(no end within 0.5 s (stopped))") in text
    assert "4 ranks, repeated, accelerate: 2 of 2 runs failed" in text
    kernel = next(ln for ln in text.splitlines() if " first in a kernel " in ln)
    assert kernel.split()[-2] == "-" and kernel.split()[-1] == "0.50x"   # lk 0.1 / fork 0.2


class _FakeRun:
    """procs.run as the launchers answer: accelerate hangs in the kernel mode, raises when
    repeated; lk takes 0.1 s, fork 0.2 s."""

    def __init__(self):
        self.killed_after = []

    def __call__(self, what, argv, timeout, **popen):
        import subprocess

        launcher, mode = argv[2], argv[3]
        if launcher == "accelerate" and mode == "kernel":
            self.killed_after.append(timeout)
            raise subprocess.TimeoutExpired(argv, timeout)
        if launcher == "accelerate" and mode == "repeat":
            return 1, "", "Traceback ...\nRuntimeError: launcher broke\n"
        return 0, "0.1\n" if launcher == "lk.run" else "0.2\n", ""
