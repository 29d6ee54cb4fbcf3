"""Claims of labkit/grading/watch.py (notebook 03 §7, the exercise checker), torch 2.13.0 gloo.

"gloo writes every collective it runs, on every process group of the process and whatever
called it, into PyTorch's flight recorder ... point-to-point send/recv are not recorded."
"the growth of that sum over the rank's sockets is what the rank put on the wire, gloo's
framing included (measured on torch 2.13: 144 bytes per isend/irecv pair on top of the
payload). The sockets of the process group's TCPStore (those on ``MASTER_PORT``) are left
out."
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import labkit as lk
from labkit.grading import watch


def _own_gloo_group(t):
    """A ProcessGroupGloo of the answer's own, on a FileStore: no torch.distributed collective.

    Every call needs a store file no earlier call used (a file a killed job left behind holds
    stale keys, and the new group then waits for ranks that are gone; a name built from the
    pool's port collided when the OS gave a later pool the same port): rank 0 draws a fresh name
    and hands it to the others through the job's TCPStore (a key-value server, not a
    collective: the flight recorder and the TCP counters leave it out). The group is let go only
    when every rank is through with it, counted on the same store: on an empty tensor gloo's
    allreduce sends nothing, and a rank that dropped its group at once closed the sockets a slower
    peer was still connecting ("Gloo connectFullMesh failed ... Connection closed by peer",
    3 jobs in 120 under load).
    """
    import uuid

    import torch._C._distributed_c10d as c10d
    rank, n = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    calls = int(os.environ.get("LABKIT_TEST_FILESTORES", "0"))      # same count on every rank
    os.environ["LABKIT_TEST_FILESTORES"] = str(calls + 1)
    key = f"labkit-test-filestore-{calls}"
    if rank == 0:
        store.set(key, f"labkit-fs-{uuid.uuid4().hex}")
    name = store.get(key).decode()
    pg = c10d.ProcessGroupGloo(dist.FileStore(os.path.join(tempfile.gettempdir(), name), n),
                               rank, n, datetime.timedelta(seconds=20))
    pg.allreduce([t]).wait()
    store.add(f"{key}-done", 1)
    while store.add(f"{key}-done", 0) < n:
        time.sleep(0.001)


def _functional(t):
    import torch.distributed._functional_collectives as fc
    t.copy_(fc.all_reduce(t, "sum", dist.group.WORLD))


def _group(t):
    dist.all_reduce(t, group=dist.new_group(backend="gloo"))


def _pair(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    for q in [dist.isend(t, (rank + 1) % n), dist.irecv(torch.empty_like(t), (rank - 1) % n)]:
        q.wait()


def _batch(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % n),
           dist.P2POp(dist.irecv, torch.empty_like(t), (rank - 1) % n)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()


def _pg_send(t):
    pg, rank = dist.distributed_c10d._get_default_group(), dist.get_rank()
    (pg.send([t], 1, 0) if rank == 0 else pg.recv([torch.empty_like(t)], 0, 0)).wait()


ROUTES = {   # name -> (what the route does, what the flight recorder must show)
    "dist.all_reduce": (lambda t: dist.all_reduce(t), ["gloo:all_reduce"]),
    "process group object": (
        lambda t: dist.distributed_c10d._get_default_group().allreduce([t]).wait(),
        ["gloo:all_reduce"]),
    "backend object": (lambda t: dist.distributed_c10d._get_default_group()._get_backend(
        torch.device("cpu")).allreduce([t]).wait(), ["gloo:all_reduce"]),
    "new_group": (_group, ["gloo:all_reduce"]),
    "own ProcessGroupGloo on a FileStore": (_own_gloo_group, ["gloo:all_reduce"]),
    "functional collective": (_functional, ["gloo:all_reduce"]),
    "all_gather_object": (lambda t: dist.all_gather_object([None] * dist.get_world_size(), 1),
                          ["gloo:all_gather", "gloo:all_gather"]),
    "broadcast": (lambda t: dist.broadcast(t, 0), ["gloo:broadcast"]),
    "reduce_scatter_tensor": (lambda t: dist.reduce_scatter_tensor(
        torch.empty(2), torch.ones(2 * dist.get_world_size())), ["gloo:all_reduce"]),
    "barrier": (lambda t: dist.barrier(), ["gloo:barrier"]),
    "isend/irecv": (_pair, []),
    "batch_isend_irecv": (_batch, []),
    "process group send/recv": (_pg_send, []),
}


def _routes_job(rank, world_size):
    out = {}
    for name, (route, _) in ROUTES.items():
        mark = watch.last_record_id()
        route(torch.ones(4))
        out[name] = watch.recorded_collectives(mark)
    return out


@pytest.mark.timeout(120)
def test_the_flight_recorder_sees_every_collective_by_every_route_and_no_p2p():
    seen = lk.run(_routes_job, 2, backend="gloo", timeout=60, echo=False).values
    for rank in range(2):
        assert {name: seen[rank][name] for name in ROUTES} == \
            {name: want for name, (_, want) in ROUTES.items()}, f"rank {rank}"


def _bytes_job(rank, world_size, numel, pairs):
    t = torch.ones(numel)
    dist.barrier()
    before = watch.tcp_bytes_sent()
    for _ in range(pairs):
        _pair(t)
    return watch.tcp_bytes_sent() - before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel,pairs", [(0, 1), (1, 3), (25_000, 2)])
def test_tcp_counters_see_the_payload_plus_144_bytes_per_pair(numel, pairs):
    sent = lk.run(_bytes_job, 3, args=(numel, pairs), backend="gloo", echo=False).values
    assert sent == [pairs * (4 * numel + 144)] * 3


def _window_job(rank, world_size, route):
    w = watch.Watch()
    w.start()
    if route == "nothing":
        pass
    elif route == "store":
        dist.distributed_c10d._get_default_store().set(f"w{rank}", b"x" * 4000)
    else:
        ROUTES[route][0](torch.ones(4))
    return w.error, w.stop()


@pytest.mark.timeout(60)
def test_a_window_counts_only_what_happened_inside_it():
    quiet = lk.run(_window_job, 2, args=("nothing",), backend="gloo", echo=False).values
    assert quiet == [("", {"collectives": [], "sent": 0, "error": ""})] * 2
    ring = lk.run(_window_job, 2, args=("isend/irecv",), backend="gloo", echo=False).values
    assert ring == [("", {"collectives": [], "sent": 16 + 144, "error": ""})] * 2
    cheat = lk.run(_window_job, 2, args=("process group object",), backend="gloo",
                   echo=False).values
    assert [v[1]["collectives"] for v in cheat] == [["gloo:all_reduce"]] * 2
    store = lk.run(_window_job, 2, args=("store",), backend="gloo", echo=False).values
    assert store == [("", {"collectives": [], "sent": 0, "error": ""})] * 2   # not gloo's


@pytest.mark.timeout(90)
def test_with_the_recorder_off_a_rank_cannot_be_watched_and_says_why():
    res = lk.run(_window_job, 2, args=("nothing",), backend="gloo", echo=False,
                 env={"TORCH_FR_BUFFER_SIZE": "0"})
    for error, seen in res.values:
        assert "TORCH_FR_BUFFER_SIZE" in error and seen["error"] == error
