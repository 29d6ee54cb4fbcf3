"""All-reduce benchmark and α–β model (labkit.collectives.bandwidth): timings printed, never asserted."""
from __future__ import annotations

import statistics

import pytest

from labkit.collectives import bandwidth as bw

MiB = 2 ** 20


def test_model_formulas():
    a, b, s = 1e-5, 1e-9, 8 * MiB
    assert bw.predict(a, b, s, 2) == pytest.approx(2 * a + s * b)          # ring, N=2
    assert bw.predict(a, b, s, 4) == pytest.approx(6 * a + 1.5 * s * b)    # 2(N-1)/N = 1.5
    assert bw.predict(a, b, s, 4, "naive") == pytest.approx(6 * a + 6 * s * b)
    assert bw.predict(a, b, s, 1024, "tree") == pytest.approx(20 * a + 2 * s * b)
    with pytest.raises(ValueError, match="'ring', 'naive' or 'tree'"):
        bw.predict(a, b, s, 4, "star")


def _rows(alpha, beta, n, impl="ring", noise=1.0):
    out = []
    for k, s in enumerate([4096, 65536, MiB, 4 * MiB]):
        t = bw.predict(alpha, beta, s, n, impl) * (noise if k % 2 else 1.0)
        out.append(dict(world_size=n, impl=impl, bytes=s, time_s=t, algbw=s / t / 1e9,
                        busbw=s / t / 1e9 * 2 * (n - 1) / n))
    return out


def test_fit_recovers_alpha_and_beta():
    rows = _rows(3e-4, 1 / 1.2e9, 2) + _rows(1e-3, 1 / 2e9, 4)
    m2, m4 = bw.fit(rows)
    assert (m2["world_size"], m4["world_size"]) == (2, 4)
    assert m2["alpha"] == pytest.approx(3e-4, rel=1e-6)
    assert m2["link_GBps"] == pytest.approx(1.2, rel=1e-6)
    assert m4["alpha"] == pytest.approx(1e-3, rel=1e-6) and m4["worst_error"] < 1e-9
    noisy = bw.fit(_rows(3e-4, 1 / 1.2e9, 2, noise=1.3))[0]
    assert 0.05 < noisy["worst_error"] < 0.3                  # the error is reported, not hidden
    with pytest.raises(ValueError, match="at least 2 message sizes"):
        bw.fit(_rows(3e-4, 1e-9, 2)[:1])


def test_the_fit_says_what_it_can_resolve():
    exact = bw.fit(_rows(3e-4, 1 / 1.2e9, 2))[0]
    assert exact["resolved"] and exact["beta_se"] == pytest.approx(0, abs=1e-15)
    assert exact["link_GBps_range"] == pytest.approx((1.2, 1.2), rel=1e-6)
    assert bw.link_text(exact) == "1/beta = 1.20 GB/s (rough 95% range 1.20 to 1.20, from 4 sizes)"
    # flat from 4 KiB to 4 MiB (what 4 ranks on 2 cores show): beta is noise, 1/beta no speed
    flat = [dict(world_size=4, impl="ring", bytes=s, time_s=t)
            for s, t in zip([4096, 65536, MiB, 4 * MiB], [2.1e-3, 1.9e-3, 2.2e-3, 2.05e-3])]
    m = bw.fit(flat)[0]
    assert not m["resolved"] and m["link_GBps_range"][1] == float("inf")
    assert "not resolved" in bw.link_text(m) and not bw.link_text(m).startswith("1/beta =")
    two = bw.fit(_rows(3e-4, 1 / 1.2e9, 2)[:2])[0]
    assert two["dof"] == 0 and "no uncertainty estimate" in bw.link_text(two)
    flat_two = bw.fit_alpha_beta([(2, 1e3, 1e-4), (2, 1e6, 0.9e-4)])   # shrinking: no speed
    assert not flat_two["resolved"] and "GB/s" not in bw.link_text(flat_two)
    grows_noisily = bw.fit_alpha_beta([(2, s, t) for s, t in  # 9x slower, but scattered
                                       [(1e3, 1e-4), (1e5, 6e-4), (1e6, 2e-4), (4e6, 9e-4)]])
    assert not grows_noisily["resolved"] and "too noisy" in bw.link_text(grows_noisily)
    negative = bw.fit_alpha_beta([(2, s, 1e-9 * s - 1e-6) for s in (1e4, 1e5, 1e6)])
    assert negative["alpha_clipped"] and negative["alpha"] == 0 and negative["beta"] > 0
    noisy = bw.fit(_rows(3e-4, 1 / 1.2e9, 2, noise=1.3))[0]     # resolved, with a wide range
    lo, hi = noisy["link_GBps_range"]
    assert lo < noisy["link_GBps"] < hi


def test_at_scale_is_labelled_and_shows_the_ring_latency_wall():
    rows = bw.at_scale(gpus=(8, 1024), sizes=(MiB, 2 ** 30))
    small = {r["gpus"]: r for r in rows if r["bytes"] == MiB}
    assert "NVLink" in small[8]["link"] and "InfiniBand" in small[1024]["link"]
    assert small[1024]["ring_s"] > 10 * small[1024]["tree_s"]          # 2(N-1)α vs 2·log2(N)·α
    big = {r["gpus"]: r for r in rows if r["bytes"] == 2 ** 30}
    assert big[1024]["ring_s"] == pytest.approx(      # 8 NICs per node carry the ring's channels
        2 * 1023 * 5e-6 + 2 * 1023 / 1024 * 2 ** 30 / min(450e9, 8 * 50e9))
    assert bw.cluster_link(8)["bandwidth"] == 450e9 and bw.cluster_link(16)["bandwidth"] == 400e9
    assert bw.scale_table(rows).startswith("MODEL PREDICTION")


def test_table_ratios_and_sizes():
    rows = [dict(world_size=2, impl=i, bytes=s, time_s=t, algbw=s / t / 1e9, busbw=s / t / 1e9)
            for i, s, t in [("dist.all_reduce", MiB, 1e-3), ("ring", MiB, 1.5e-3),
                            ("dist.all_reduce", 4096, 1e-4), ("ring", 4096, 5e-4)]]
    text = bw.table(rows)
    assert "x dist" in text and "1.50" in text and "1 MiB" in text
    assert bw.ratios(rows) == [1.5]                        # only messages >= 1 MiB
    assert [bw.fmt_bytes(x) for x in (512, 4096, 3 * MiB, 2 ** 30)] == \
        ["512 B", "4 KiB", "3 MiB", "1 GiB"]
    assert bw.FULL_SIZES[0] == 4096 and bw.FULL_SIZES[-1] == 64 * MiB


def test_ratios_pair_run_i_of_one_with_run_i_of_the_other():
    """Run i of each ran side by side: the ratio is taken run by run, then the median (the
    ratio of the medians here would be 3.0 / 2.0 = 1.5; the paired runs say 1.0 or 2.0)."""
    rows = [dict(world_size=2, impl="dist.all_reduce", bytes=4 * MiB, time_s=2.0,
                 runs_s=[1.0, 2.0, 4.0]),
            dict(world_size=2, impl="ring", bytes=4 * MiB, time_s=3.0, runs_s=[2.0, 3.0, 4.0])]
    for r in rows:
        r.update(algbw=r["bytes"] / r["time_s"] / 1e9, busbw=r["bytes"] / r["time_s"] / 1e9)
    assert bw.paired(rows[1], rows[0]) == [1.0, 1.5, 2.0]
    assert bw.ratios(rows, min_bytes=4 * MiB) == [1.5]
    rows[1]["runs_s"] = [4.0, 2.0, 3.0]                     # the same times, other pairs
    assert bw.paired(rows[1], rows[0]) == [0.75, 1.0, 4.0]
    assert bw.ratios(rows) == [1.0] and "1.00 (0.75-4.00)" in bw.table(rows)


def test_measure_refuses_bad_arguments():
    with pytest.raises(ValueError, match="impls must come from"):
        bw.measure(impls=("ring", "tree"), progress=False)
    with pytest.raises(ValueError, match=">= 4"):
        bw.measure(sizes=[2], progress=False)


@pytest.mark.timeout(120)
def test_measure_runs_every_impl_and_reports_busbw():
    rows = bw.measure(sizes=[4096, 65536], world_sizes=(3,), iters=2, backend="gloo",
                      progress=False)
    assert [(r["impl"], r["bytes"]) for r in rows] == [
        (i, s) for s in (4096, 65536) for i in bw.IMPLS]
    for r in rows:
        assert r["time_s"] > 0 and r["runs"] == 2 and len(r["runs_s"]) == 2
        assert r["time_s"] == pytest.approx(statistics.median(r["runs_s"]))
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 4 / 3)
    fig = bw.plot(rows, bw.fit(rows))
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 4     # 3 measured + 1 model line


@pytest.mark.timeout(120)
def test_cli_prints_the_table_and_the_labelled_prediction(capsys):
    assert bw.main(["--sizes", "4096", "4194304", "--world-sizes", "2", "--iters", "2",
                   "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "busbw GB/s" in out and "ring / dist.all_reduce on 2 ranks, messages >= 4 MiB" in out
    assert "alpha-beta fit, ring on 2 ranks" in out and "MODEL PREDICTION" in out
