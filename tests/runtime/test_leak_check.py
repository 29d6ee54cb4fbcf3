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


def test_an_orphan_of_a_tree_is_found_by_its_mark_too():
    from labkit.runtime import procs

    tree = procs.Tree("leak-check tree")
    try:
        with pytest.raises(pytest.fail.Exception, match="left processes running"):
            with nothing_left_behind(grace=0.5):
                # a grandchild that outlives its parent: re-parented to init, found by its mark
                subprocess.run(["sh", "-c", "sleep 120 &"],
                               env=tree.env({"PATH": "/usr/bin:/bin"}), check=True)
        assert not tree.live()                  # the check killed it
    finally:
        tree.stop()


def test_the_warm_pool_is_kept_on_purpose():
    from labkit.runtime import procs

    with nothing_left_behind(grace=0.5):
        lk.run(lambda rank, world_size: rank, world_size=2, echo=False)
    pool = procs.kept()
    assert len(pool) >= 3 and all(psutil.pid_exists(p) for p in pool)   # zygote + 2 ranks
    assert pool <= set(procs.ours()) and not pool & set(procs.ours(kept_too=False))
