"""Runner logic without processes: validation, stack parsing, error building."""
from __future__ import annotations

import threading

import psutil
import pytest

import labkit as lk
from labkit.runtime.errors import error_for
from labkit.runtime.pickling import with_sources
from labkit.runtime.result import JobResult, RankResult, error_kind
from labkit.runtime.stacks import Frame, parse_stack, where_stuck


def step(rank, world_size):
    return rank


def _no_children():
    return psutil.Process().children(recursive=True) == []


@pytest.fixture(autouse=True)
def _clean():
    lk.shutdown()
    yield
    lk.shutdown()


@pytest.mark.parametrize("world_size, words", [
    (0, "outside 1.."), (-2, "outside 1.."), (10_000, "outside 1.."),
    (2.5, "whole number"), (True, "whole number"), ("4", "whole number"),
])
def test_bad_world_size_is_refused_before_anything_starts(world_size, words):
    with pytest.raises(lk.InvalidJob, match=words):
        lk.run(step, world_size=world_size)
    assert _no_children()


def test_non_callable_is_refused():
    with pytest.raises(lk.InvalidJob, match="needs a function"):
        lk.run(42, world_size=2)
    assert _no_children()


def test_unknown_backend_names_the_choices():
    with pytest.raises(lk.InvalidJob, match="auto, gloo, nccl"):
        lk.run(step, world_size=2, backend="mpi2")
    assert _no_children()


@pytest.mark.parametrize("backend, world_size, gpus, want", [
    ("auto", 2, 0, "gloo"), ("auto", 4, 2, "gloo"),            # fewer GPUs than ranks: CPU
    ("auto", 2, 2, "cpu:gloo,cuda:nccl"), ("auto", 4, 8, "cpu:gloo,cuda:nccl"),
    ("nccl", 2, 2, "cpu:gloo,cuda:nccl"),                      # CPU tensors keep working
    ("gloo", 2, 8, "gloo"),
])
def test_the_backend_policy_keeps_gloo_for_cpu_tensors_on_a_gpu_box(monkeypatch, backend,
                                                                    world_size, gpus, want):
    """Issue: plain "nccl" made every lesson cell that all-reduces a CPU tensor fail on a GPU
    box ("No backend type associated with device type cpu"). GPU counts faked."""
    from labkit.runtime import launch

    monkeypatch.setattr(launch, "_gpu_count", lambda zygote: gpus)
    assert launch._resolve_backend(backend, world_size, None) == want


def test_device_follows_the_group_not_the_machine(monkeypatch):
    """lk.ddp.device() is cuda:<rank> on a plain or a device-mapped NCCL group, else CPU."""
    import torch
    import torch.distributed as dist

    from labkit.common import ranks

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for backend, want in (("cpu:gloo,cuda:nccl", "cuda:1"), ("nccl", "cuda:1"), ("gloo", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert str(ranks.device()) == want and ranks.uses_nccl() == (want != "cpu")


def test_nccl_without_gpus_is_refused_before_anything_starts():
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    with pytest.raises(lk.BackendUnavailable, match="needs one GPU per rank.*backend='gloo'"):
        lk.run(step, world_size=2, backend="nccl")
    assert _no_children()


def test_signature_mismatch_is_explained():
    def no_rank():
        return 1

    with pytest.raises(lk.InvalidJob, match=r"no_rank\(rank, world_size"):
        lk.run(no_rank, world_size=2)
    with pytest.raises(lk.InvalidJob, match="cannot be called"):
        lk.run(step, world_size=2, args=(1,))
    assert _no_children()


@pytest.mark.parametrize("kw, words", [
    (dict(timeout=0), "timeout must be a positive"), (dict(deadline=-1), "deadline must be"),
    (dict(threads=0), "threads must be"), (dict(args=5), "args must be a tuple"),
    (dict(env={"X": 1}), "env values must be strings"),
])
def test_bad_options(kw, words):
    with pytest.raises(lk.InvalidJob, match=words):
        lk.run(step, world_size=2, **kw)


def test_unpicklable_argument_is_named():
    def takes(rank, world_size, a, b):
        return a

    with pytest.raises(lk.InvalidJob, match=r"args\[1\] \(lock\) cannot be sent"):
        lk.run(takes, world_size=2, args=(1, threading.Lock()))
    assert _no_children()


DUMP = '''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007ff61e277b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_1/123.py", line 6 in step
  File "/work/main/labkit/runtime/zygote.py", line 214 in _run_job
  File "/work/main/labkit/runtime/zygote.py", line 185 in rank_main
'''


def test_parse_stack_keeps_the_job_thread_without_runner_frames():
    frames = parse_stack(DUMP)
    assert [f.func for f in frames] == ["all_reduce", "wrapper", "step"]


def test_where_stuck_names_the_collective_and_the_caller(monkeypatch):
    import linecache

    monkeypatch.setitem(linecache.cache, "/tmp/ipykernel_1/123.py",
                        (0, None, ["\n"] * 5 + ["    dist.all_reduce(t)\n"], "/tmp/ipykernel_1/123.py"))
    assert where_stuck(parse_stack(DUMP)) == \
        "all_reduce, called from step (line 6: dist.all_reduce(t))"
    assert where_stuck([Frame("/x/user.py", 3, "spin")]) == "spin (user.py:3)"
    assert "no Python frames" in where_stuck([])


def test_with_sources_fills_in_cell_lines(monkeypatch):
    import linecache

    monkeypatch.setitem(linecache.cache, "/tmp/ipykernel_1/9.py",
                        (0, None, ["x = 1\n", "raise ValueError('boom')\n"], "/tmp/ipykernel_1/9.py"))
    tb = 'Traceback (most recent call last):\n  File "/tmp/ipykernel_1/9.py", line 2, in step\n' \
         'ValueError: boom\n'
    assert "    raise ValueError('boom')" in with_sources(tb)


def _result(*ranks):
    return JobResult(world_size=len(ranks), backend="gloo", ranks=list(ranks))


@pytest.mark.parametrize("rank, cls", [
    (RankResult(1, "raised", error="ValueError: boom", traceback="tb", t_fail=1.0), lk.RankError),
    (RankResult(1, "unpicklable", error="returned a generator", t_fail=1.0), lk.ResultNotPicklable),
    (RankResult(1, "exited", exitcode=3, t_fail=1.0), lk.RankCrashed),
    (RankResult(1, "signaled", signal="SIGABRT", t_fail=1.0), lk.RankCrashed),
])
def test_error_class_follows_the_first_failure(rank, cls):
    later = RankResult(0, "raised", error="RuntimeError: Connection closed by peer", t_fail=2.0)
    err = error_for(_result(later, rank))
    assert type(err) is cls
    assert str(err).startswith("rank 1 ")
    assert "rank 0 raised RuntimeError" in str(err)
    assert err.failed_ranks == [0, 1]


def test_hung_ranks_without_other_failures_are_a_timeout():
    err = error_for(_result(RankResult(0, "ok", value=1),
                                   RankResult(1, "hung", where="spin (x.py:1)")))
    assert type(err) is lk.JobTimeout
    assert str(err).startswith("rank 1 was stuck in spin (x.py:1)")
    assert "rank 0 returned normally" in str(err)


def test_describe_each_status():
    assert RankResult(2, "signaled", signal="SIGABRT",
                      stderr="terminate called\n  what():  size mismatch\n").describe() == \
        "rank 2 was killed by SIGABRT (what():  size mismatch)"
    assert RankResult(0, "exited", exitcode=3).describe() == \
        "rank 0 exited with code 3 before returning"
    assert RankResult(1, "hung", where="x").describe() == "rank 1 was stuck in x"


@pytest.mark.parametrize("error", [
    "RuntimeError: Connection closed by peer [127.0.0.1]:4242",
    # rank 0's process hosts the job's TCPStore: when it ends, a peer in store.get reads this
    "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the "
    "remote server shutdown or crash?",
])
def test_a_peer_s_echo_is_not_taken_for_the_first_failure(error):
    cause = RankResult(0, "raised", error="RuntimeError: Gloo connectFullMesh failed", t_fail=2.0)
    echo = RankResult(1, "raised", error=error, t_fail=1.0)
    assert error_kind(error) == "echo"
    assert str(error_for(_result(cause, echo))).startswith("rank 0 ")
