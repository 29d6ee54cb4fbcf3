"""Real jobs on real ranks (gloo): values, output, warm reuse, environments, lifetimes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import labkit as lk
from conftest import live_ranks, needs_gpus

pytestmark = pytest.mark.timeout(120)


def hello(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_on_n_ranks(n):
    assert lk.run(hello, world_size=n, echo=False).values == [n * (n + 1) / 2] * n


def test_args_and_kwargs_pass_through():
    def f(rank, world_size, a, b=0, *, c):
        return (rank, world_size, a, b, c)

    res = lk.run(f, world_size=2, args=(1,), kwargs={"b": 2, "c": 3}, echo=False)
    assert res.values == [(0, 2, 1, 2, 3), (1, 2, 1, 2, 3)]


def test_functions_defined_in_main_closures_and_lambdas_ship_by_value():
    # A function whose module is __main__ (as in a notebook) cannot be found by name in a
    # child; exec into a fake __main__ namespace reproduces exactly that situation.
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        SCALE = 10
        def notebook_fn(rank, world_size):
            import torch, torch.distributed as dist
            t = torch.tensor([rank * SCALE]); dist.all_reduce(t); return int(t)
    """), ns)
    factor = 7
    assert lk.run(ns["notebook_fn"], world_size=3, echo=False).values == [30, 30, 30]
    assert lk.run(lambda rank, ws: rank * factor, world_size=2, echo=False).values == [0, 7]


def test_process_group_is_ready_and_env_is_like_torchrun():
    def f(rank, world_size):
        import torch
        import torch.distributed as dist

        return (dist.is_initialized(), dist.get_rank(), dist.get_world_size(),
                dist.get_backend(), os.environ["RANK"], os.environ["WORLD_SIZE"],
                os.environ["MASTER_ADDR"], torch.get_num_threads())

    res = lk.run(f, world_size=2, echo=False)
    assert res.values[1] == (True, 1, 2, "gloo", "1", "2", "127.0.0.1", 1)
    assert res.backend == "gloo"


def test_output_is_captured_per_rank_and_echoed_in_rank_order(capsys):
    def f(rank, world_size):
        import time

        time.sleep(0.05 * (world_size - rank))  # rank 2 finishes first
        print(f"hello from {rank}")
        os.write(2, f"raw fd write {rank}\n".encode())  # what C++ code does
        return rank

    res = lk.run(f, world_size=3)
    assert res.stdout == [f"hello from {r}\n" for r in range(3)]
    assert res.stderr == [f"raw fd write {r}\n" for r in range(3)]
    out = capsys.readouterr()
    assert out.out == "".join(f"[rank {r}] hello from {r}\n" for r in range(3))
    assert out.err == "".join(f"[rank {r}] raw fd write {r}\n" for r in range(3))
    assert all(w > 0.0 for w in res.wall_s)


def test_a_warm_rank_s_output_holds_its_last_job_only():
    """A rank writes every job's output to the same two files, emptied when a job starts."""
    def long(rank, world_size):
        print("x" * 5000)
        os.write(2, b"y" * 3000)

    def short(rank, world_size):
        print("ok")

    first = lk.run(long, world_size=2, echo=False)
    second = lk.run(short, world_size=2, echo=False)
    assert not second.cold and second.ranks[0].pid == first.ranks[0].pid
    assert second.stdout == ["ok\n", "ok\n"] and second.stderr == ["", ""]


def test_warm_ranks_are_reused_and_fresh_ones_on_request():
    pids = lambda **kw: lk.run(lambda r, w: os.getpid(), world_size=2, echo=False, **kw)  # noqa: E731
    first = pids()
    assert pids().values == first.values
    again = pids(fresh=True)
    assert again.cold and set(again.values).isdisjoint(first.values)


def test_each_job_reseeds_ranks_like_fresh_processes():
    def draw(rank, world_size):
        import torch

        return float(torch.rand(1))

    a = lk.run(draw, world_size=2, echo=False).values
    b = lk.run(draw, world_size=2, echo=False).values
    assert a[0] != a[1], "forked ranks must not share one random stream"
    assert a != b


def test_device_seeding_is_queued_before_any_job_and_a_job_s_own_seed_replaces_it():
    """The rank seeds every device type once at its start: CUDA's seeding waits in torch's
    lazy queue (CPU build included), so a job's torch.manual_seed replaces that entry instead
    of creating it inside the job, where the exercise checkers' census would count it."""
    def queued(rank, world_size):
        import torch

        before = torch.cuda._lazy_seed_tracker.manual_seed_all_cb
        torch.manual_seed(0)
        after = torch.cuda._lazy_seed_tracker.manual_seed_all_cb
        return before is not None, after is not before, torch.initial_seed()

    first = lk.run(queued, world_size=2, echo=False, fresh=True)
    again = lk.run(queued, world_size=2, echo=False)
    assert not again.cold
    assert [v[:2] for v in first.values + again.values] == [(True, True)] * 4
    assert {v[2] for v in first.values} == {0}


def test_ranks_and_their_threads_run_under_batch_scheduling_unless_turned_off():
    """SCHED_BATCH: a woken rank does not preempt the notebook's kernel as it hands out a job."""
    def policies(rank, world_size):
        import threading

        seen = [os.sched_getscheduler(0)]
        worker = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        worker.start()
        worker.join()
        return seen

    assert lk.run(policies, world_size=2, echo=False).values == [[os.SCHED_BATCH] * 2] * 2
    assert lk.run(policies, world_size=2, echo=False, env={"LABKIT_BATCH_RANKS": "0"}).values \
        == [[os.SCHED_OTHER] * 2] * 2
    assert os.sched_getscheduler(0) == os.SCHED_OTHER     # the notebook's process is not touched


def test_what_a_rank_starts_with_is_frozen_and_a_job_s_garbage_still_collected():
    """gc.freeze() at the rank's start: torch's objects out of every later collection's
    sight (a collection in 4 ranks at once stalled a repeated job), a job's cycles freed;
    still frozen after labkit.grading.integrity's census (it unfreezes as it ends)."""
    def job(rank, world_size):
        import gc
        import weakref

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a                  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        return gc.get_freeze_count(), gone() is None

    for frozen, freed in lk.run(job, world_size=2, echo=False, fresh=True).values:
        assert frozen > 50_000 and freed, (frozen, freed)

    def census(rank, world_size):            # an exercise checker's census, in the same ranks
        import gc

        from labkit.grading.integrity import Census
        with Census():
            pass
        return gc.get_freeze_count()
    assert all(frozen > 50_000 for frozen in lk.run(census, world_size=2, echo=False).values)


def test_per_job_environment_gets_fresh_processes():
    def f(rank, world_size):
        import torch.distributed as dist

        return os.environ.get("TORCH_DISTRIBUTED_DEBUG"), str(dist.get_debug_level())

    plain = lk.run(f, world_size=2, echo=False)
    detail = lk.run(f, world_size=2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, echo=False)
    assert plain.values[0][0] is None
    assert detail.values[0] == ("DETAIL", "DebugLevel.DETAIL")
    assert lk.run(f, world_size=2, echo=False).values[0][0] is None


def test_returned_tensors_come_back_detached_on_cpu():
    def f(rank, world_size):
        import torch

        w = torch.ones(3, requires_grad=True)
        return {"grad_fn_output": w * 2, "list": [w]}

    v = lk.run(f, world_size=2, echo=False).values[0]
    assert not v["grad_fn_output"].requires_grad and v["grad_fn_output"].tolist() == [2.0] * 3


def test_shutdown_leaves_no_process():
    lk.run(hello, world_size=2, echo=False)
    assert live_ranks()
    lk.shutdown()
    assert psutil.Process().children(recursive=True) == []
    assert lk.run(hello, world_size=2, echo=False).values == [3.0, 3.0]


def test_two_kernels_run_jobs_at_the_same_time(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import labkit as lk
        def f(rank, world_size):
            import torch, torch.distributed as dist
            for _ in range(200):
                t = torch.ones(1); dist.all_reduce(t)
            return int(t)
        print(lk.run(f, world_size=2, echo=False).values)
    """))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=90)[0].strip() for p in procs]
    assert outs == ["[2, 2]", "[2, 2]"]


def test_ranks_die_with_their_kernel(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, psutil, labkit as lk
        lk.run(lambda r, w: None, world_size=2, echo=False)
        kids = [p.pid for p in psutil.Process().children(recursive=True)]
        print(" ".join(map(str, kids)), flush=True)
        time.sleep(60)
    """))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in kernel.stdout.readline().split()]
    assert len(pids) == 3  # the launcher and two ranks
    kernel.send_signal(signal.SIGKILL)  # a kernel that dies without cleaning up
    kernel.wait()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_idle_ranks_and_launcher_go_away(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import time, psutil, labkit as lk
        lk.run(lambda r, w: None, world_size=2, echo=False)
        end = time.monotonic() + 30  # idle timeout 1 s for ranks, then 1 s for the launcher
        while psutil.Process().children(recursive=True) and time.monotonic() < end:
            time.sleep(0.1)
        print(len(psutil.Process().children(recursive=True)))
        print(lk.run(lambda r, w: r, world_size=2, echo=False).values)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                         env={**os.environ, "LABKIT_IDLE_TIMEOUT": "1"})
    assert out.stdout.split("\n")[:2] == ["0", "[0, 1]"], out.stderr


@needs_gpus(2)
@pytest.mark.gpu
def test_nccl_all_reduce_on_two_gpus():
    def f(rank, world_size):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(rank + 1)], device=torch.device("cuda", rank))
        dist.all_reduce(t)
        return t  # comes back on the CPU

    res = lk.run(f, world_size=2, backend="nccl", echo=False)
    assert res.backend == "nccl" and [float(v) for v in res.values] == [3.0, 3.0]
    assert all(v.device.type == "cpu" for v in res.values)
