"""Where the runner runs: Linux; elsewhere lk.run refuses at once, naming the platform and the
way out, before any process starts (the platform check is simulated here)."""
from __future__ import annotations

import sys

import pytest

import labkit as lk
from labkit.runtime import check_platform, launch, procs


@pytest.mark.parametrize("platform, words", [
    ("win32", "WSL2"), ("cygwin", "WSL2"), ("darwin", "macOS"), ("freebsd14", "Linux"),
])
def test_other_platforms_are_refused_with_the_way_out(platform, words):
    with pytest.raises(lk.UnsupportedPlatform, match=words) as info:
        check_platform(platform)
    assert repr(platform) in str(info.value) and "tested on Linux only" in str(info.value)
    assert isinstance(info.value, lk.InvalidJob)   # a refused job, like any bad argument


def test_linux_is_served():
    check_platform("linux")


def test_lk_run_refuses_before_starting_anything(monkeypatch):
    lk.shutdown()
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(lk.UnsupportedPlatform, match="Linux machine, VM or container"):
        lk.run(lambda rank, world_size: rank, world_size=2)
    with pytest.raises(lk.UnsupportedPlatform):
        lk.warmup()
    assert procs.kept() == set() and not launch._zygotes
