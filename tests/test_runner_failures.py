"""The failure table: every way a rank can fail, each named, bounded in time, leaving nothing behind."""
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
    import time

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


# case: (function, run options, error class, text the message must contain, time bound in s)
CASES = {
    "raise": (raises, {}, lk.RankError, "rank 1 raised ValueError: boom", 15),
    "os._exit": (exits, {}, lk.RankCrashed, "rank 1 exited with code 3", 15),
    "sys.exit": (sys_exits, {}, lk.RankCrashed, "rank 1 exited with code 4", 15),
    "SIGKILL": (kills_itself, {}, lk.RankCrashed, "rank 1 was killed by SIGKILL", 15),
    "hang": (sleeps_instead, dict(timeout=30, deadline=2), lk.JobTimeout,
             "rank 0 was stuck in all_reduce, called from sleeps_instead", 15),
    "skipped collective": (skips_collective, dict(timeout=2), lk.RankError,
                           "rank 0 raised RuntimeError", 15),
    "unpicklable return": (returns_generator, {}, lk.ResultNotPicklable,
                           "returned a builtins.generator that cannot be pickled", 15),
    "size mismatch": (size_mismatch, dict(timeout=5), lk.RankCrashed, "killed by SIGABRT", 15),
}


@pytest.mark.parametrize("case", list(CASES))
def test_failure_is_named_bounded_and_cleaned_up(case):
    fn, opts, cls, words, bound = CASES[case]
    lk.run(lambda r, w: None, world_size=2, echo=False)  # warm: time only the failure
    t0 = time.monotonic()
    with pytest.raises(lk.JobFailed) as info:
        lk.run(fn, world_size=2, echo=False, **opts)
    elapsed = time.monotonic() - t0
    assert type(info.value) is cls, str(info.value)
    assert words in str(info.value)
    assert elapsed < bound, f"{case} took {elapsed:.1f} s to surface"
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


def test_keyboard_interrupt_kills_the_job():
    lk.run(lambda r, w: None, world_size=3, echo=False)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        lk.run(sleeps_instead, world_size=3, timeout=30, echo=False)
    assert time.monotonic() - t0 < 10
    assert_no_ranks_left()
    assert lk.run(lambda r, w: r, world_size=3, echo=False).values == [0, 1, 2]


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


def test_interrupt_while_ranks_start_discards_the_launcher(monkeypatch):
    from labkit import _procs

    lk.shutdown()
    def interrupted(self, limit):
        raise KeyboardInterrupt

    monkeypatch.setattr(_procs.Pool, "_rendezvous", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lk.run(lambda r, w: r, world_size=2, echo=False)
    monkeypatch.undo()
    assert_no_ranks_left()
    assert lk.run(lambda r, w: r, world_size=2, echo=False).values == [0, 1]
