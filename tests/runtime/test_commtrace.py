"""lk.run(..., trace=True): every collective and point-to-point op of every rank, recorded on real
gloo ranks without changing the job's code; trace=False installs nothing."""
from __future__ import annotations

import json
import sys

import cloudpickle
import pytest

import labkit as lk
from labkit.runtime.commtrace import FIELDS, CommTrace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

pytestmark = pytest.mark.timeout(120)


def every_op(rank, world_size):
    """All collectives, blocking and async p2p, a ProcessGroup method and a subgroup."""
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(250)                                   # 1000 bytes
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    dist.all_gather([torch.zeros(250) for _ in range(world_size)], t)
    dist.all_gather_into_tensor(torch.zeros(250 * world_size), t)
    dist.reduce_scatter_tensor(torch.zeros(250), torch.ones(250 * world_size))
    dist.all_to_all_single(torch.zeros(250 * world_size), torch.ones(250 * world_size))
    dist.reduce(t, dst=0)
    if rank == 0:
        dist.send(t, dst=1)
        work = dist.isend(torch.ones(100), dst=1)
        time.sleep(0.01)
        work.wait()
    elif rank == 1:
        dist.recv(t, src=0)
        dist.irecv(torch.zeros(100), src=0).wait()
    handle = dist.all_reduce(t, async_op=True)
    handle.wait()
    dist.distributed_c10d._get_default_group().allreduce([t]).wait()   # a method, not dist.*
    pair = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(torch.ones(10), group=pair)
    dist.barrier()
    return rank


EXPECTED = ["all_reduce", "broadcast", "all_gather", "all_gather", "reduce_scatter",
            "all_to_all", "reduce"]


def test_trace_records_every_collective_and_p2p_op_on_every_rank():
    res = lk.run(every_op, 3, trace=True, echo=False)
    tr = res.trace
    assert isinstance(tr, CommTrace) and len(tr) == 3
    for rank in range(3):
        recs = tr[rank]
        assert all(set(FIELDS) == set(r) for r in recs)
        kinds = [r["kind"] for r in recs]
        p2p = {0: ["send", "send"], 1: ["recv", "recv"], 2: []}[rank]
        tail = ["all_reduce", "all_reduce"] + (["all_reduce"] if rank < 2 else []) + ["barrier"]
        assert kinds == EXPECTED + p2p + tail, kinds
        assert [r["bytes"] for r in recs[:7]] == [1000, 1000, 3000, 3000, 3000, 3000, 1000]
        assert all(r["rank"] == rank and r["end"] is not None and r["end"] >= r["start"]
                   for r in recs)
        assert recs[1]["peer"] == 1 and recs[6]["peer"] == 0      # broadcast / reduce roots
        assert all(r["group_ranks"] == (0, 1, 2) for r in recs if r["bytes"] != 40)
        # every blocking dist.* call waited on its work: a wait span inside the op
        assert all(r["wait_start"] is not None and r["start"] <= r["wait_start"] <= r["wait_end"]
                   for r in recs)
    sends, recvs = tr.select(kind="send"), tr.select(kind="recv")
    assert [(r["bytes"], r["peer"]) for r in sends] == [(1000, 1), (400, 1)]
    assert [(r["bytes"], r["peer"]) for r in recvs] == [(1000, 0), (400, 0)]
    sub = [r for r in tr.select(kind="all_reduce") if r["bytes"] == 40]
    assert sorted((r["rank"], r["group_ranks"], r["group_size"]) for r in sub) == [
        (0, (0, 1), 2), (1, (0, 1), 2)]


def test_matched_collectives_line_up_across_ranks_and_totals_add_up():
    tr = lk.run(every_op, 3, trace=True, echo=False).trace
    matched = tr.matched()
    world = [m for m in matched if m["group_ranks"] == (0, 1, 2)]
    assert [m["kind"] for m in world] == EXPECTED + ["all_reduce", "all_reduce", "barrier"]
    assert all(sorted(m["arrivals"]) == [0, 1, 2] for m in world)
    assert [m["group_ranks"] for m in matched if m["group_ranks"] != (0, 1, 2)] == [(0, 1)]
    totals = tr.totals(rank=2)
    assert totals["all_reduce"]["calls"] == 3 and totals["all_reduce"]["bytes"] == 3000
    assert tr.bytes(rank=0, kind="send") == 1400


def straggler(rank, world_size, late, seconds):
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == late:
        time.sleep(seconds)
    dist.all_reduce(t)
    return t[0].item()


def test_a_straggler_is_named_and_its_peers_waits_are_visible():
    res = lk.run(straggler, 3, args=(1, 0.4), trace=True, echo=False)
    tr = res.trace
    second = tr.matched()[1]
    assert second["last"] == 1 and second["skew"] >= 0.3      # slept 0.4 s: a lower bound
    for rank in (0, 2):
        rec = [r for r in tr[rank] if r["kind"] == "all_reduce"][1]
        assert rec["wait_end"] - rec["wait_start"] >= 0.15    # blocked until rank 1 came
    spans = tr.spans()
    assert {s["lane"] for s in spans[0]} == {"comm", "wait"}
    fig = lk.plots.comm_timeline(tr, title="rank 1 is late")
    assert "rank 1 reached all_reduce" in fig.axes[0].get_title()


def test_chrome_trace_export_is_valid_trace_event_json(tmp_path):
    tr = lk.run(every_op, 3, trace=True, echo=False).trace
    path = tmp_path / "job.json"
    tr.to_chrome(str(path))
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and events
    names = {(e["pid"], e["args"]["name"]) for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
    ops = [e for e in spans if e["cat"] == "comm"]
    assert len(ops) == sum(len(recs) for recs in tr)
    by_thread: dict = {}
    for e in sorted(ops, key=lambda e: e["ts"]):       # ops on one thread never overlap
        key = (e["pid"], e["tid"])
        assert e["ts"] >= by_thread.get(key, 0.0) - 1e-6
        by_thread[key] = e["ts"] + e["dur"]


def dispatch_state(rank, world_size):
    import threading

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Work
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    dist.all_reduce(torch.ones(4))
    patched = (Work.wait, torch._C.Future.then, torch._C.Future.add_done_callback,
               threading._start_new_thread)
    return ([type(m).__name__ for m in _get_current_dispatch_mode_stack()],
            [getattr(f, "__module__", None) for f in patched])


def test_trace_false_installs_nothing_and_trace_true_cleans_up():
    plain = lk.run(dispatch_state, 2, echo=False)
    assert plain.trace is None and all(r.trace is None for r in plain.ranks)
    traced = lk.run(dispatch_state, 2, trace=True, echo=False)
    modes, modules = traced.values[0]
    assert modes == ["_CommMode"] and modules == ["labkit.runtime.commtrace"] * 4
    after = lk.run(dispatch_state, 2, echo=False)              # the same warm ranks
    assert after.values == [([], plain.values[0][1])] * 2 and plain.values[0][0] == []
    assert "labkit.runtime.commtrace" not in plain.values[0][1]


def other_threads(rank, world_size):
    """Collectives from a threading.Thread, a raw _thread and an add_done_callback callback
    (gloo's own thread), each waited for before the next, so every rank issues the same order."""
    import _thread
    import threading
    import time

    import torch
    import torch.distributed as dist

    worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(3)), name="helper")
    worker.start()
    worker.join()
    done, works = threading.Event(), []
    _thread.start_new_thread(lambda: (dist.all_reduce(torch.ones(5)), done.set()), ())
    done.wait(10)
    done.clear()
    if rank == 1:            # rank 0's future then pends while its callback is added, so the
        time.sleep(0.5)      # callback runs on gloo's thread there (a done future runs it inline)
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    fut.add_done_callback(lambda _: (works.append(dist.all_reduce(torch.ones(7),
                                                                 async_op=True)), done.set()))
    done.wait(10)
    works[0].wait()
    return [threading.current_thread().name]


def test_collectives_from_every_python_thread_and_callback_are_recorded():
    res = lk.run(other_threads, 2, trace=True, echo=False)
    for rank in range(2):
        recs = res.trace[rank]
        assert [r["bytes"] for r in recs] == [12, 20, 8, 28], recs
        threads = [r["thread"] for r in recs]
        main = res.values[rank][0]
        assert threads[0] == "helper" and threads[2] == main
        assert threads[1] not in (main, "helper")
    assert res.trace[0][3]["thread"] != res.values[0][0]       # rank 0's callback: gloo's thread


def kept_tensors(rank, world_size):
    import torch
    import torch.distributed as dist

    from labkit.runtime.commtrace import CommRecorder

    t = torch.full((4,), float(rank + 1), dtype=torch.float16)
    with CommRecorder(keep_tensors=True) as tap:
        dist.all_reduce(t)
        t.fill_(-1.0)                        # what the op sent and received stays as it was
    with CommRecorder() as plain:
        dist.all_reduce(t)
    [rec] = tap.records
    return ([x.tolist() for x in rec["sent"]], [x.tolist() for x in rec["received"]],
            "sent" in plain.records[0])


def test_keep_tensors_copies_what_an_op_sent_before_it_ran_and_what_it_received():
    res = lk.run(kept_tensors, 2, echo=False)
    assert res.values == [([[1.0] * 4], [[3.0] * 4], False), ([[2.0] * 4], [[3.0] * 4], False)]


def test_trace_must_be_a_bool():
    with pytest.raises(lk.InvalidJob, match="trace must be True or False"):
        lk.run(dispatch_state, 2, trace="yes")


def raises_after_one(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))
    if rank == 1:
        raise ValueError("boom")
    return rank


def test_a_rank_that_raised_keeps_its_trace():
    res = lk.run(raises_after_one, 2, trace=True, check=False, echo=False)
    assert not res.ok and res[1].status == "raised"
    assert [r["kind"] for r in res.trace[1]] == ["all_reduce"]


def ddp_backward(rank, world_size):
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.runtime import commtrace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0)
    sizes = []

    def counting(state, bucket):
        sizes.append(bucket.buffer().numel() * 4)
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, counting)
    for step in range(3):
        with commtrace.label(f"step {step}"):
            ddp(torch.randn(8, 64)).sum().backward()
    return sizes


def test_ddp_bucket_all_reduces_from_cpp_are_recorded_with_their_bytes():
    res = lk.run(ddp_backward, 2, trace=True, echo=False)
    sizes = res.values[0]
    tr = res.trace
    last = tr.select(rank=0, kind="all_reduce", label="step 2")
    assert len(last) >= 2                                     # several buckets
    assert sum(r["bytes"] for r in last) == sum(sizes[-len(last):])
    params = (64 * 64 + 64) * 2 + 64 * 4 + 4
    assert sum(r["bytes"] for r in last) == params * 4


def test_comm_trace_logic_on_synthetic_records():
    def rec(rank, kind, start, end, ranks=(0, 1), nbytes=8, wait=None):
        return {"rank": rank, "seq": 0, "kind": kind, "op": kind, "bytes": nbytes,
                "dtype": "torch.float32", "group_size": len(ranks), "group_ranks": ranks,
                "peer": None, "label": "", "start": start, "end": end,
                "wait_start": wait and wait[0], "wait_end": wait and wait[1], "thread": "Main"}
    tr = CommTrace([[rec(0, "all_reduce", 1.0, 3.0, wait=(1.0, 3.0)),
                     rec(0, "all_reduce", 1.5, 2.0)],
                    [rec(1, "all_reduce", 2.5, 3.0), rec(1, "all_reduce", 2.6, 2.9)]])
    first, second = tr.matched()
    assert first["last"] == 1 and first["skew"] == pytest.approx(1.5)
    assert second["skew"] == pytest.approx(1.1)
    assert tr.waits(0) == pytest.approx(2.0) and tr.waits(1) == 0
    lanes = {e["tid"] for e in tr.to_chrome()["traceEvents"] if e.get("cat") == "comm"
             and e["pid"] == 0}
    assert lanes == {1, 2}                  # the async op overlaps the first: its own thread
    assert "all_reduce x4" in repr(tr)


def gloo_p2p_work(rank, world_size):
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(16)
    work = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)
    try:
        work.get_future()
        has_future = True
    except RuntimeError:
        has_future = False
    time.sleep(0.2)                        # the message has long arrived
    before = work.is_completed()
    work.wait()
    return has_future, before, work.is_completed()


def test_why_p2p_ends_come_from_wait_gloo_p2p_works_have_no_future_and_complete_on_wait():
    """commtrace's design rests on this (torch 2.13, gloo): a send/recv Work has no future and
    says is_completed() == False until wait() is called, so polling cannot time it."""
    assert lk.run(gloo_p2p_work, 2, echo=False).values == [(False, False, True)] * 2
