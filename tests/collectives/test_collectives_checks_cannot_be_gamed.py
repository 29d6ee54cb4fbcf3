"""The ring exercise (03.ring_all_reduce) cannot be passed without writing a ring.

Each lazy or wrong answer below must fail a named case, with a detail that says why, and the
solution must still pass everything. Most answers run on 2 ranks only (faster); the ones
whose only flaw is the traffic run on 3. The classes of shortcut, and the tests that feed them:

* hidden state: n.a. as a class of its own: each call gets a tensor drawn from a secret the
  rank draws per grading, so state kept from an earlier call holds nothing of this one
  (``reads_the_oracle`` keeps none and still fails);
* the library doing the work: ``test_a_collective_by_any_route_fails_every_case``
  (dist.*, the group object, its backend, a group of its own, all_gather), and
  ``test_the_lab_s_own_all_reduce_fails_every_case`` (lk's ring, its naive version, notebook
  06's reduce-scatter and all-gather: point-to-point underneath, so only their marks show);
* a copied oracle: ``reads_the_oracle`` (the checker's own case generator);
* a side channel: the same test's ``from_a_thread``, and
  ``test_a_side_channel_fails_every_case`` (the process group's TCPStore, a file in /tmp);
* a computation not split as required: ``tutorial_ring`` and ``hidden_master`` (the whole
  tensor sent instead of one chunk per step).
"""
from __future__ import annotations

import glob
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

import labkit as lk
from labkit.collectives import check as ringcheck

from test_collectives import solution_ring   # the notebook's solution
from test_watch import _own_gloo_group as own_gloo_on_a_file_store   # no torch.distributed API


# ---------------------------------------------------------------- lazy and wrong answers
def do_nothing(tensor):
    return tensor


def library_all_reduce(tensor):
    dist.all_reduce(tensor)


def process_group_method(tensor):
    """The issue's example: the default group's own method, no dist.* collective in sight."""
    dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()


def backend_object(tensor):
    pg = dist.distributed_c10d._get_default_group()
    pg._get_backend(torch.device("cpu")).allreduce([tensor]).wait()


def own_group(tensor):
    dist.all_reduce(tensor, group=dist.new_group(backend="gloo"))


def from_a_thread(tensor):
    """The library's all-reduce, issued from a helper thread the answer starts and joins."""
    worker = threading.Thread(target=dist.all_reduce, args=(tensor,))
    worker.start()
    worker.join()


def _call_number() -> int:
    """How many times this rank has called a side-channel answer: the same on every rank."""
    calls = int(os.environ.get("LABKIT_TEST_SIDE_CALLS", "0"))
    os.environ["LABKIT_TEST_SIDE_CALLS"] = str(calls + 1)
    return calls


def through_the_store(tensor):
    """Every rank puts its tensor into the process group's TCPStore and reads the others'."""
    import io
    store, n, me = dist.distributed_c10d._get_default_store(), dist.get_world_size(), \
        dist.get_rank()
    call, buf = _call_number(), io.BytesIO()
    torch.save(tensor.contiguous(), buf)
    store.set(f"side/{call}/{me}", buf.getvalue())
    parts = [torch.load(io.BytesIO(store.get(f"side/{call}/{r}"))) for r in range(n)]
    tensor.copy_(sum(parts[1:], parts[0].clone()))


def through_a_file(tensor):
    """Every rank saves its tensor to a file in /tmp and loads the others' (named after the
    job's store port and this call, so no earlier job's file is read)."""
    n, me, call = dist.get_world_size(), dist.get_rank(), _call_number()
    name = os.path.join(tempfile.gettempdir(),
                        f"labkit-ring-side-{os.getppid()}-{os.environ['MASTER_PORT']}-{call}-{{}}.pt")
    torch.save(tensor.contiguous(), name.format(f"{me}.tmp"))
    os.replace(name.format(f"{me}.tmp"), name.format(me))
    deadline = time.monotonic() + 4
    while not all(os.path.exists(name.format(r)) for r in range(n)) and \
            time.monotonic() < deadline:
        time.sleep(0.005)
    parts = [torch.load(name.format(r)) for r in range(n)]
    tensor.copy_(sum(parts[1:], parts[0].clone()))


def gather_then_add(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    tensor.copy_(sum(parts))


def reads_the_oracle(tensor):
    """Rebuild every rank's input from the checker's own generator instead of communicating."""
    n, me = dist.get_world_size(), dist.get_rank()
    for name in ringcheck.CASES:
        mine = ringcheck.case_tensor(name, me, n)
        if mine.shape == tensor.shape and mine.dtype == tensor.dtype:
            return sum(ringcheck.case_tensor(name, r, n) for r in range(n))
    return tensor


def two_ranks_only(tensor):
    """Swap with 'the other' rank: right on 2 ranks, wrong on more."""
    me, flat = dist.get_rank(), tensor.contiguous().clone()
    other = torch.empty_like(flat)
    for q in [dist.isend(flat, 1 - me % 2), dist.irecv(other, 1 - me % 2)]:
        q.wait()
    return flat + other


def reduce_to_rank_0_only(tensor):
    """Every rank sends to rank 0, which adds: right on rank 0 only."""
    me, n, flat = dist.get_rank(), dist.get_world_size(), tensor.contiguous().clone()
    if me == 0:
        for src in range(1, n):
            buf = torch.empty_like(flat)
            dist.recv(buf, src)
            flat += buf
    else:
        dist.send(flat, 0)
    return flat


def tutorial_ring(tensor):
    """The whole tensor passed around the ring N-1 times (right sums, (N-1)·S bytes per rank)."""
    me, n = dist.get_rank(), dist.get_world_size()
    acc, passing = tensor.contiguous().clone(), tensor.contiguous().clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        for q in [dist.isend(passing, (me + 1) % n), dist.irecv(incoming, (me - 1) % n)]:
            q.wait()
        acc += incoming
        passing = incoming
    return acc


def hidden_master(tensor):
    """The naive master approach through the group object's send/recv, which no patch of
    dist.isend sees: the kernel's byte counters still do."""
    pg, me, n = dist.distributed_c10d._get_default_group(), dist.get_rank(), dist.get_world_size()
    flat = tensor.contiguous().clone()
    if me == 0:
        for src in range(1, n):
            buf = torch.empty_like(flat)
            pg.recv([buf], src, 0).wait()
            flat += buf
        for dst in range(1, n):
            pg.send([flat], dst, 0).wait()
    else:
        pg.send([flat], 0, 0).wait()
        pg.recv([flat], 0, 0).wait()
    return flat


def fake_rows(tensor):
    """Print the checker's own row format, claiming success, and do nothing."""
    import json
    for name in ringcheck.CASES:
        print("@labkit-row " + json.dumps(dict(case=name, ok=True, status="ok", detail="",
                                                digest=0, numel=1, element_size=4, sent=0,
                                                collectives=[], unwatched="")))
    return tensor


# ---------------------------------------------------------------- the checks
def _failed(fn, world_sizes=(2,), **kw):
    cases = ringcheck.check_ring_exercise(fn, world_sizes=world_sizes, **kw)
    return cases, {c.name: c.detail for c in cases if not c.passed}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [do_nothing, reads_the_oracle, fake_rows])
def test_an_answer_that_does_not_communicate_passes_no_case(fn):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases) == len(ringcheck.CASES)
    assert "element 0 is" in failed["2 ranks, divisible"]
    assert "the call right after it is wrong" in failed["2 ranks, empty"]


@pytest.mark.timeout(120)
def test_do_nothing_scores_zero_on_every_world_size():
    score = lk.exercise.evaluate("03.ring_all_reduce", do_nothing)
    assert (score.points, score.status) == (0.0, "wrong")
    assert "not counted: the result was wrong" in score.cases[-1].detail   # 4 ranks, traffic


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [library_all_reduce, process_group_method, backend_object,
                                own_group, own_gloo_on_a_file_store, gather_then_add,
                                from_a_thread])
def test_a_collective_by_any_route_fails_every_case(fn):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases)
    used = "all_gather" if fn is gather_then_add else "all_reduce"
    for name, detail in failed.items():
        assert f"ran a collective ({used})" in detail, (name, detail)


def lab_ring(tensor):
    return lk.collectives.ring_all_reduce(tensor)


def lab_naive(tensor):
    from labkit.collectives.allreduce import naive_all_reduce as mine
    return mine(tensor)


def lab_halves(tensor):
    """Notebook 06's ring halves: reduce-scatter, then all-gather, on a flat copy."""
    from labkit.sharding.ring import ring_all_gather, ring_reduce_scatter
    flat = tensor.reshape(-1).clone()
    n = dist.get_world_size()
    pad = torch.cat([flat, flat.new_zeros((-flat.numel()) % n)])
    whole = ring_all_gather(ring_reduce_scatter(pad))[:flat.numel()]
    tensor.copy_(whole.view_as(tensor))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, name", [(lab_ring, "collectives.allreduce.ring_all_reduce"),
                                      (lab_naive, "collectives.allreduce.naive_all_reduce"),
                                      (lab_halves, "sharding.ring.ring_all_gather, lk's "
                                                   "sharding.ring.ring_reduce_scatter")])
def test_the_lab_s_own_all_reduce_fails_every_case(fn, name):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases)
    for case, detail in failed.items():
        assert "the lab's own implementation did the work" in detail and name in detail, \
            (case, detail)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [through_the_store, through_a_file])
def test_a_side_channel_fails_every_case(fn):
    """Right sums, no collective: the bytes went around gloo's sockets, not through them."""
    try:
        cases, failed = _failed(fn)
    finally:
        for left in glob.glob(os.path.join(tempfile.gettempdir(), "labkit-ring-side-*.pt")):
            if os.path.isfile(left):        # this test's files only: other lessons' tests
                os.remove(left)             # use other names, and may be running now
    assert set(failed) == {c.name for c in cases} - {"2 ranks, empty"}, failed
    for name, detail in failed.items():
        assert detail.startswith("side channel: rank 0's result is right, but its gloo "
                                 "sockets sent 0 bytes"), (name, detail)


@pytest.mark.timeout(60)
def test_an_answer_for_two_ranks_fails_on_three():
    _, failed = _failed(two_ranks_only, world_sizes=(2, 3))
    assert not any(name.startswith("2 ranks") for name in failed)
    assert "3 ranks, divisible" in failed


@pytest.mark.timeout(60)
def test_a_reduce_without_the_way_back_fails_on_the_other_ranks():
    _, failed = _failed(reduce_to_rank_0_only)
    assert failed["2 ranks, divisible"].startswith("rank 1: ")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", [tutorial_ring, hidden_master])
def test_right_sums_with_too_many_bytes_fail_the_traffic_case(fn):
    _, failed = _failed(fn, world_sizes=(3,))
    assert "a ring sends 2(N-1)/N·S" in failed.pop("3 ranks, bytes sent per rank")
    # each rank of the tutorial's ring adds in its own order: float results differ by rank
    assert failed == ({} if fn is hidden_master else
                      {"3 ranks, random floats": "ranks hold different results: every rank "
                                                 "must end with the same tensor"})


@pytest.mark.timeout(120)
def test_the_solution_still_passes_everything():
    score = lk.exercise.evaluate("03.ring_all_reduce", solution_ring)
    assert score.status == "correct", [(c.name, c.detail) for c in score.cases if not c.passed]


@pytest.mark.timeout(90)
def test_a_case_the_checker_cannot_watch_fails():
    """With the flight recorder off a collective would go unseen: the case fails, saying so."""
    res = lk.run(ringcheck.compare_job, 2, args=(solution_ring, ["divisible"], "sum", True),
                 backend="gloo", env={"TORCH_FR_BUFFER_SIZE": "0"}, echo=False)
    rows = [ringcheck._rows_of(res[r]) for r in range(2)]
    passed, detail = ringcheck._verdict(2, "divisible", rows, res)
    assert not passed and detail.startswith("cannot verify on rank 0: PyTorch's flight recorder")
