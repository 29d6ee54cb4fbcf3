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
