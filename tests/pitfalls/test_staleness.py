"""Gradient staleness: the delay-k simulation (pure) and the real asynchronous parameter server."""
from __future__ import annotations

import math

import pytest
import torch

import labkit as lk
from labkit.pitfalls import staleness as st
from labkit.pitfalls.check import check_staleness_lr


def test_quadratic_has_unit_curvature():
    a, _ = st.quadratic()
    h = a.T @ a / len(a)
    assert float(torch.linalg.eigvalsh(h)[-1]) == pytest.approx(1.0)


def test_no_delay_is_gradient_descent():
    a, b = st.quadratic()
    w = torch.zeros(a.shape[1], dtype=torch.float64)
    for _ in range(5):
        w = w - 0.5 * a.T @ (a @ w - b) / len(b)
    assert st.delayed_sgd(0, 0.5, 5)[-1] == pytest.approx(float(0.5 * ((a @ w - b) ** 2).mean()))


def test_delay_diverges_at_a_rate_that_works_without_it():
    sweep = st.staleness_sweep((0, 1, 4, 16), lr=1.0, steps=120)
    assert sweep[0][-1] < 1e-3
    assert math.isinf(sweep[4][-1]) or sweep[4][-1] > 1e6
    assert all(len(v) == 120 for v in sweep.values())


def test_staleness_aware_rate_converges_at_every_delay():
    for k in (1, 4, 16):
        assert st.delayed_sgd(k, 1.0, 300, lambda lr, s: lr / (s + 1))[-1] < 0.01


def test_staleness_lr_checker():
    assert all(c.passed for c in check_staleness_lr(lambda lr, s: lr / (s + 1)))
    plain = check_staleness_lr(lambda lr, s: lr)
    assert [c.name for c in plain if c.passed] == ["lr itself at staleness 0", "delay 0"]
    frozen = check_staleness_lr(lambda lr, s: 0.0)
    assert not frozen[0].passed and "staleness 0" in frozen[0].detail


@pytest.mark.timeout(90)
def test_parameter_server_sync_has_no_staleness_and_async_does():
    sync = st.parameter_server(world_size=4, mode="sync", updates=30)
    assert sync.staleness == [0] * 30 and sync.losses[-1] < 0.01
    run = st.parameter_server(world_size=4, mode="async", updates=60)
    assert len(run.staleness) == 60 and set(run.sources) == {1, 2, 3}
    assert st.mean_staleness(run) > 0.5 and max(run.staleness) >= 2
    aware = st.parameter_server(world_size=4, mode="aware", updates=60)
    assert aware.losses[-1] < 0.01           # lr / staleness keeps it stable
    assert "mean staleness" in repr(run)


def test_parameter_server_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        st.parameter_server(mode="eventual")
    with pytest.raises(ValueError, match="world_size"):
        st.parameter_server(world_size=1)


def test_reexported_through_pitfalls():
    assert lk.pitfalls.parameter_server is st.parameter_server
    assert "delayed_sgd" in dir(lk.pitfalls)
