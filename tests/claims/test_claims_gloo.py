"""Claim tests: what gloo does on torch 2.13.0 (point-to-point, broadcast, AVG), on real ranks.

Each docstring quotes the sentence of the notebook it backs (see ``tests/claims/_claims.py``).
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import labkit as lk

import _claims

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

pytestmark = pytest.mark.timeout(120)


def _send_waits_for_recv(rank, world_size, numel):
    import time

    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        dist.send(torch.ones(numel), dst=1)
        return store.check(["recv_posted"])     # was the peer's recv posted before send returned?
    time.sleep(0.5)                             # the receiver is late ...
    store.set("recv_posted", "1")               # ... then posts its recv
    dist.recv(torch.empty(numel), src=0)
    return None


def _both_send_first(rank, world_size):
    import torch
    import torch.distributed as dist

    try:
        dist.send(torch.ones(4), dst=1 - rank)
    except RuntimeError:
        return "timed out in send"
    return "send returned"


@pytest.mark.parametrize("numel", [1, 4, 2**20])
def test_gloo_send_returns_only_after_the_peer_posted_its_recv(numel):
    """03 "6.1": “On gloo (torch 2.13.0, the backend of this run) a blocking `send` returns only
    once the peer has posted the matching `recv`, even for a single element”."""
    res = lk.run(_send_waits_for_recv, 2, args=(numel,), timeout=10, echo=False, fresh=True)
    assert res.values[0] is True, f"gloo's send of {numel} elements returned before the recv"


def test_two_ranks_that_both_send_first_deadlock_on_gloo():
    """03 "6.1": “If both ranks send before they receive, neither `recv` is ever posted: a
    deadlock”."""
    res = lk.run(_both_send_first, 2, timeout=2, deadline=10, echo=False, fresh=True)
    assert res.values == ["timed out in send"] * 2


def _broadcast_without(rank, world_size, absent):
    import time

    import torch
    import torch.distributed as dist

    if rank == absent:
        time.sleep(3.0)                         # never calls the broadcast
        return "absent"
    t = torch.full((4,), float(rank))
    try:
        dist.broadcast(t, src=0)
    except RuntimeError:
        return "timed out"
    return "got it" if t.eq(0).all() else "wrong data"


@pytest.mark.parametrize("absent, outcome", [
    (2, ["timed out", "got it", "absent", "got it"]),      # 2 is a leaf: 1 and 3 are served
    (1, ["timed out", "absent", "got it", "timed out"]),   # 3 waits for its parent, rank 1
    (3, ["got it", "timed out", "got it", "absent"]),      # rank 1 waits to serve 3
])
def test_gloo_broadcast_is_a_binomial_tree(absent, outcome):
    """04 "Exercise: which rank hung": “gloo broadcasts along a binomial tree: rank 0 sends to
    rank 1, then rank 0 to rank 2 and rank 1 to rank 3”."""
    res = lk.run(_broadcast_without, 4, args=(absent,), timeout=2, deadline=12, echo=False,
                 fresh=True)
    assert res.values == outcome


def _recv_other_size(rank, world_size, numel):
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.send(torch.ones(4), dst=1)
        return "sent"
    buf = torch.full((numel,), -1.0)
    dist.recv(buf, src=0)
    return buf.tolist()


def test_gloo_recv_of_another_size_aborts_or_passes_silently():
    """01 "7 · Common pitfalls": “on gloo (torch 2.13.0) a message bigger than the receive buffer
    aborts the receiving process (`SIGABRT`), and a smaller one is accepted without any error,
    leaving the rest of the buffer as it was”."""
    small = lk.run(_recv_other_size, 2, args=(3,), timeout=5, deadline=15, echo=False,
                   check=False, fresh=True)
    assert [r.status for r in small.ranks] == ["ok", "signaled"] and small[1].signal == "SIGABRT"
    big = lk.run(_recv_other_size, 2, args=(6,), timeout=5, echo=False, fresh=True)
    assert big.values[1] == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]


def _average(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def test_gloo_all_reduce_accepts_avg():
    """03 "6.4": “`op=dist.ReduceOp.AVG` divides inside the collective: NCCL has it (since NCCL
    2.10), and so does gloo on torch 2.13.0”."""
    assert lk.run(_average, 2, timeout=10, echo=False).values == [1.5, 1.5]


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
