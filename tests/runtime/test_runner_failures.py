"""The failure table: every way a rank can fail, each named, bounded in time, leaving nothing behind.

Ctrl-C during a job, at every stage: tests/runtime/test_interrupts.py.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import labkit as lk
from conftest import assert_no_ranks_left

pytestmark = pytest.mark.timeout(120)


def raises(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


def exits(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def sys_exits(rank, world_size):
    import sys

    if rank == 1:
        sys.exit(4)
    return rank


def kills_itself(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def sleeps_instead(rank, world_size):

    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def skips_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank


def returns_generator(rank, world_size):
    return (i for i in range(3))


def size_mismatch(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4 + rank))


class _BreaksOnLoad:
    """Pickles in the rank; rebuilding it raises (a ``__reduce__`` that fails on load)."""

    def __reduce__(self):
        return (_refuse_to_load, ("rank-side state",))


def _refuse_to_load(state):
    raise RuntimeError(f"cannot rebuild {state!r} here")


def returns_unloadable(rank, world_size):
    return _BreaksOnLoad()


def returns_rank_only_class(rank, world_size):
    """An instance of a class from a module only the rank can import (pickled by reference)."""
    import importlib
    import os
    import sys
    import tempfile

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "rank_only_module.py"), "w") as f:
        f.write("class Point:\n    def __init__(self, x):\n        self.x = x\n")
    sys.path.insert(0, folder)
    return importlib.import_module("rank_only_module").Point(rank)


# case: (function, run options, error class, text the message must contain). Each case is
# bounded by the test's pytest timeout: the options' own limits are a few seconds.
CASES = {
    "raise": (raises, {}, lk.RankError, "rank 1 raised ValueError: boom"),
    "os._exit": (exits, {}, lk.RankCrashed, "rank 1 exited with code 3"),
    "sys.exit": (sys_exits, {}, lk.RankCrashed, "rank 1 exited with code 4"),
    "SIGKILL": (kills_itself, {}, lk.RankCrashed, "rank 1 was killed by SIGKILL"),
    "hang": (sleeps_instead, dict(timeout=30, deadline=2), lk.JobTimeout,
             "rank 0 was stuck in all_reduce, called from sleeps_instead"),
    "skipped collective": (skips_collective, dict(timeout=2), lk.RankError,
                           "rank 0 raised RuntimeError"),
    "unpicklable return": (returns_generator, {}, lk.ResultNotPicklable,
                           "returned a builtins.generator that cannot be pickled"),
    "unloadable in the notebook": (returns_unloadable, {}, lk.ResultNotPicklable,
                                   "_BreaksOnLoad that was pickled in the rank but cannot be "
                                   "unpickled in the notebook (RuntimeError: cannot rebuild"),
    "class only the rank can import": (
        returns_rank_only_class, {}, lk.ResultNotPicklable,
        "returned a rank_only_module.Point that was pickled in the rank but cannot be "
        "unpickled in the notebook (ModuleNotFoundError"),
    "size mismatch": (size_mismatch, dict(timeout=5), lk.RankCrashed, "killed by SIGABRT"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CASES))
def test_failure_is_named_bounded_and_cleaned_up(case):
    fn, opts, cls, words = CASES[case]
    lk.run(lambda r, w: None, world_size=2, echo=False)  # warm: only the failure is bounded
    with pytest.raises(lk.JobFailed) as info:
        lk.run(fn, world_size=2, echo=False, **opts)
    assert type(info.value) is cls, str(info.value)
    assert words in str(info.value)
    assert info.value.result is not None and not info.value.result.ok
    assert_no_ranks_left()
    assert lk.run(lambda r, w: r, world_size=2, echo=False).values == [0, 1]


def test_raise_carries_the_remote_traceback():
    with pytest.raises(lk.RankError) as info:
        lk.run(raises, world_size=2, echo=False)
    cause = info.value.__cause__
    assert isinstance(cause, lk.RemoteTraceback)
    assert 'in raises' in cause.tb and 'raise ValueError("boom")' in cause.tb
    assert "_run_job" not in cause.tb  # runner frames are not the learner's business
    assert info.value.result[0].status in ("raised", "hung")


def test_a_failed_rank_never_frees_its_exception(tmp_path):
    """A rank that raised leaves with os._exit, its exception (and the frames in its traceback:
    a DDP model, its gloo group) never freed: freeing a failed step can hang the rank
    (labkit/portable/ending.py). An object of the failing frame is never finalized."""
    def fails_holding(rank, world_size, folder):
        import pathlib

        class Finalized:
            def __del__(self):
                pathlib.Path(folder, f"freed{rank}").write_text("")
        held = Finalized()  # noqa: F841
        raise ValueError(f"rank {rank} fails")

    with pytest.raises(lk.RankError, match="fails"):
        lk.run(fails_holding, world_size=2, args=(str(tmp_path),), echo=False)
    assert_no_ranks_left()
    assert list(tmp_path.iterdir()) == []


def test_hung_ranks_show_where_they_are_stuck():
    res = lk.run(sleeps_instead, world_size=2, timeout=30, deadline=2, check=False, echo=False)
    assert [r.status for r in res.ranks] == ["hung", "hung"]
    assert res[0].where.startswith("all_reduce, called from sleeps_instead")
    assert "time.sleep(60)" in res[1].where
    assert "sleeps_instead" in res[1].stack


def test_a_rank_killed_from_outside_is_named():
    pids = lk.run(lambda r, w: os.getpid(), world_size=2, echo=False).values
    threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL)).start()
    with pytest.raises(lk.RankCrashed, match="rank 1 was killed by SIGKILL"):
        lk.run(sleeps_instead, world_size=2, timeout=30, echo=False)
    assert_no_ranks_left()


def test_failed_job_output_is_still_printed(capsys):
    def chatty(rank, world_size):
        print(f"about to fail on {rank}")
        raise RuntimeError("nope")

    with pytest.raises(lk.RankError):
        lk.run(chatty, world_size=2)
    out = capsys.readouterr().out
    assert "[rank 0] about to fail on 0\n" in out and "[rank 1] about to fail on 1\n" in out


def test_check_false_returns_the_failed_result():
    res = lk.run(raises, world_size=2, check=False, echo=False)
    assert not res.ok and res.failed_ranks and res.first_failure().rank == 1
