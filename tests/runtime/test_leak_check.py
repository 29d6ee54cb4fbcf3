"""The leak check that runs around every test (tests/conftest.py) can fail, and keeps what it
should: a test that leaves a process running fails; the runner's warm pool does not count."""
from __future__ import annotations

import subprocess

import psutil
import pytest
from conftest import nothing_left_behind

import labkit as lk


def test_a_process_left_running_fails_the_test_and_is_killed():
    with pytest.raises(pytest.fail.Exception, match=r"left processes running[\s\S]*sleep 120"):
        with nothing_left_behind(grace=0.5):
            proc = subprocess.Popen(["sleep", "120"])
    assert proc.wait(timeout=5) != 0            # killed by the check, and reaped here


def test_an_orphaned_torchrun_worker_is_found_too():
    from labkit.runtime import torchrun

    env = {torchrun.TOKEN: "leak-check-token"}
    torchrun._started.add("leak-check-token")
    try:
        with pytest.raises(pytest.fail.Exception, match="left processes running"):
            with nothing_left_behind(grace=0.5):
                # a grandchild that outlives its parent: re-parented to init, found by its token
                subprocess.run(["sh", "-c", "sleep 120 &"], env={**env, "PATH": "/usr/bin:/bin"},
                               check=True)
    finally:
        torchrun._started.discard("leak-check-token")
    assert not torchrun.live_processes("leak-check-token")


def test_the_warm_pool_is_kept_on_purpose():
    with nothing_left_behind(grace=0.5):
        lk.run(lambda rank, world_size: rank, world_size=2, echo=False)
    pool = lk.runtime.managed_pids()
    assert len(pool) >= 3 and all(psutil.pid_exists(p) for p in pool)   # zygote + 2 ranks
