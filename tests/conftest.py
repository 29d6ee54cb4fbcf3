"""Shared fixtures and helpers: no test may leave a process behind.

:func:`no_process_left_behind` runs around **every** test (autouse), whatever order the tests
run in: a process the test started that is still alive a few seconds after it ended (a rank,
a kernel, a torchrun agent or worker, even one re-parented to init) fails the test and is
killed. The runner's own warm pool and zygotes are kept on purpose
(:func:`labkit.runtime.procs.kept`); every other process a job starts must be gone. What
"ours" means is asked of one place, :func:`labkit.runtime.procs.ours`.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path

import psutil
import pytest


def lab_processes() -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(zygotes, ranks) of this process: zygotes are children, ranks grandchildren."""
    zygotes, ranks = [], []
    for child in psutil.Process().children():
        try:
            if any("labkit.runtime.zygote" in part for part in child.cmdline()):
                zygotes.append(child)
                ranks.extend(child.children())
        except psutil.NoSuchProcess:
            pass
    return zygotes, ranks


def live_ranks() -> list[psutil.Process]:
    alive = []
    for p in lab_processes()[1]:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def zombies() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_ranks_left(within: float = 10.0) -> None:
    """After a failed job every rank must be gone (killed and reaped), no zombie left.

    ``within``: how long a SIGKILLed rank may take to be reaped on a loaded machine (a bound on
    "gone", not a speed target)."""
    end = time.monotonic() + within
    while (live_ranks() or zombies()) and time.monotonic() < end:
        time.sleep(0.05)
    assert live_ranks() == [], f"ranks left running: {live_ranks()}"
    assert zombies() == [], f"zombie processes: {zombies()}"


def marked_with(name: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment holds ``name=value``: the mark a test put on a command
    it started, which every process that command starts inherits."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(name) == value:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def has_gpus(n: int) -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.device_count() >= n
    except Exception:  # noqa: BLE001
        return False


def _is_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _started_here(p: psutil.Process, before: set[int]) -> bool:
    """Did the test start ``p``? Its nearest ancestor that already lived before the test is
    this process, a rank launcher (its ranks must be gone or warm), or none (an orphan).
    Processes a long-lived fixture's own process starts (a browser's helpers, kernels of a
    JupyterLab server, which its test shuts down and checks itself) belong to that fixture."""
    try:
        for parent in p.parents():
            if parent.pid == os.getpid():
                return True
            if parent.pid in before:
                return any("labkit.runtime.zygote" in part for part in parent.cmdline())
    except psutil.Error:
        return False
    return True


@contextlib.contextmanager
def nothing_left_behind(grace: float = 5.0):
    """Fail (and kill what is left) if the block leaves a process of its own running, or a child
    of this process unreaped (a zombie: started, ended, never waited for).

    The runner's warm pool and zygotes are kept on purpose: :func:`labkit.runtime.procs.kept`.
    """
    from labkit.runtime import procs

    before = set(procs.ours())
    yield

    def leaked() -> list[psutil.Process]:
        return [p for pid, p in procs.ours(kept_too=False).items()
                if pid not in before and _started_here(p, before)
                ] + [p for p in psutil.Process().children() if p.pid not in before
                     and _is_zombie(p)]                             # unreaped children too
    end = time.monotonic() + grace
    while leaked() and time.monotonic() < end:   # a process may take a moment to be reaped
        time.sleep(0.05)
    left = leaked()
    if left:
        names = []
        for p in left:
            try:
                names.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            except psutil.Error:
                names.append(str(p.pid))
            try:
                p.kill()
            except psutil.Error:
                pass
        _wait_dead(left, 5.0)   # "now killed" means dead: a SIGKILL lands asynchronously
        pytest.fail("the test left processes running (now killed):\n  " + "\n  ".join(names),
                    pytrace=False)


def _wait_dead(procs: list[psutil.Process], within: float) -> None:
    """Until each process is gone or a zombie, without reaping it (its parent may wait on it)."""
    end = time.monotonic() + within
    while [p for p in procs if p.is_running() and not _is_zombie(p)] and time.monotonic() < end:
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Around every test: a process the test started must be gone when it ends."""
    with nothing_left_behind():
        yield


gpu = pytest.mark.gpu
needs_gpus = lambda n: pytest.mark.skipif(not has_gpus(n), reason=f"needs {n} CUDA GPUs")  # noqa: E731

os.environ.setdefault("LABKIT_PRESTART", "0")


def pytest_collection_modifyitems(config, items):
    """Each student notebook executes once: where the browser test runs it in JupyterLab (and
    grades its kernel), nbval does not run ``notebooks/NN.ipynb`` again. Without a browser, or
    when the browser test is not collected, nbval runs them as usual. Then the longest files
    go first (:data:`LONG_FIRST`)."""
    browsed = {m.group(1) for item in items
               if (m := re.search(r"test_notebook_in_jupyterlab\[(.+)\]$", item.nodeid))}
    if browsed and _browser_available():
        twice = [item for item in items if item.nodeid.startswith("notebooks/")
                 and Path(str(item.fspath)).stem in browsed]
        if twice:
            config.hook.pytest_deselected(items=twice)
            items[:] = [item for item in items if item not in twice]
    items.sort(key=_long_ones_first)


# The files that take longest (the last full run's --durations), in that order. xdist's
# --dist loadfile hands out files in collection order: a long file collected late leaves one
# worker running it alone at the end (the browser test did: 8 of 22 minutes). Longest first
# keeps both workers busy to the end. Only the order changes, never what runs.
LONG_FIRST = ("tests/notebooks/test_browser.py", "tests/capstone/test_capstone_check.py",
              "solutions/08_capstone.ipynb", "solutions/05_torchrun.ipynb",
              "tests/grading/test_grade.py", "solutions/04_pitfalls.ipynb",
              "tests/capstone/test_capstone_torchrun.py", "tests/torchrun/test_torchrun.py",
              "tests/claims/test_claims_torchrun.py")


def _long_ones_first(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)


def _browser_available() -> bool:
    sys.path.insert(0, str(Path(__file__).parent / "notebooks"))
    try:
        from browser_helpers import missing
    finally:
        sys.path.pop(0)
    return not missing()
