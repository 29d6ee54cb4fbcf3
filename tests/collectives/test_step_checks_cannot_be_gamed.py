"""The core build of notebook 03 §2 (03.reduce_scatter_step) cannot be passed without picking
the right chunks.

Each lazy, wrong or shortcut answer below must fail a named case, with a detail that says why,
and the solution must pass everything. Most answers run on 3 ranks only (two steps: enough to
tell an indexing from its neighbours); the ones whose flaw shows elsewhere say why. The classes
of shortcut, and the tests that feed them:

* lazy and wrong answers: ``do_nothing``, ``rebinds`` (a new tensor, not the chunk),
  ``replaces`` (overwrites instead of adding), ``adds_into_the_sent_chunk``; the off-by-one
  indexings ``numbered_from_one`` and ``one_step_ahead`` (each a ring, but a rotated one: every
  rank still ends with one complete chunk, the wrong one), ``ignores_s`` (right on 2 ranks
  only), ``mismatched`` (sends one chunk, receives into another);
* hidden state: ``counts_its_calls`` (its own call counter instead of ``s``: the second
  reduce-scatter of a job shows it) and ``does_every_step_at_once`` (every message in step 0,
  the states kept in a global and handed out later: the bytes of each step show it);
* the library doing the work: ``test_a_collective_by_any_route_fails_every_case``
  (dist.all_reduce, dist.reduce_scatter, the process group object, a thread);
* the lab's own ring: ``test_the_lab_s_own_ring_fails_every_case`` (``ring_schedule``, the
  ring's private schedule, ``ring_all_reduce``, notebook 06's ``ring_reduce_scatter``);
* a copied oracle: ``reads_the_oracle`` (the checker's own generator and replay);
* a side channel: ``through_the_store``, ``through_a_file`` (and the thread above);
* not split as required: ``whole_tensor`` (the whole tensor sent in every step: right numbers,
  too many bytes).
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
from labkit.collectives.check import step as stepcheck


def solution_step(chunks, rank, n, s):
    """The notebook's solution."""
    send = chunks[(rank - s) % n]
    recv = chunks[(rank - s - 1) % n]
    incoming = lk.collectives.send_right_recv_left(send, recv)
    recv += incoming


# ---------------------------------------------------------------- lazy and wrong answers
def do_nothing(chunks, rank, n, s):
    return None


def rebinds(chunks, rank, n, s):
    recv = chunks[(rank - s - 1) % n]
    recv = recv + lk.collectives.send_right_recv_left(chunks[(rank - s) % n], recv)  # noqa: F841


def replaces(chunks, rank, n, s):
    recv = chunks[(rank - s - 1) % n]
    recv.copy_(lk.collectives.send_right_recv_left(chunks[(rank - s) % n], recv))


def adds_into_the_sent_chunk(chunks, rank, n, s):
    send = chunks[(rank - s) % n]
    send += lk.collectives.send_right_recv_left(send, chunks[(rank - s - 1) % n])


def numbered_from_one(chunks, rank, n, s):
    """Steps read as 1, 2, ...: in step s rank r sends chunk (r - (s - 1))."""
    send, recv = chunks[(rank - s + 1) % n], chunks[(rank - s) % n]
    recv += lk.collectives.send_right_recv_left(send, recv)


def one_step_ahead(chunks, rank, n, s):
    send, recv = chunks[(rank - s - 1) % n], chunks[(rank - s - 2) % n]
    recv += lk.collectives.send_right_recv_left(send, recv)


def ignores_s(chunks, rank, n, s):
    """Step 0's chunks in every step: right on 2 ranks (one step), wrong on more."""
    send, recv = chunks[rank], chunks[(rank - 1) % n]
    recv += lk.collectives.send_right_recv_left(send, recv)


def mismatched(chunks, rank, n, s):
    """Receives into the chunk it sends: the neighbour's chunk lands in the wrong place."""
    send = recv = chunks[(rank - s) % n]
    recv += lk.collectives.send_right_recv_left(send, recv)


_CALLS = [0]


def counts_its_calls(chunks, rank, n, s):
    """Its own step counter instead of s: right for the first reduce-scatter of a process."""
    step = _CALLS[0]
    _CALLS[0] += 1
    send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
    recv += lk.collectives.send_right_recv_left(send, recv)


_AHEAD: dict = {}


def does_every_step_at_once(chunks, rank, n, s):
    """All n-1 exchanges in step 0, on a copy kept in a module global; each later step only
    copies the kept state in: right numbers after every step, the messages in the wrong one."""
    if s == 0:
        work = torch.cat(chunks)
        parts, _AHEAD["states"] = work.tensor_split(n), []
        for t in range(n - 1):
            recv = parts[(rank - t - 1) % n]
            recv += lk.collectives.send_right_recv_left(parts[(rank - t) % n], recv)
            _AHEAD["states"].append(work.clone())
    state, start = _AHEAD["states"][s], 0
    for c in chunks:
        c.copy_(state[start:start + c.numel()])
        start += c.numel()


# ---------------------------------------------------------------- the library doing the work
def _left_chunk_by_all_reduce(chunks, rank, n, s, group=None):
    """Every rank's step-s chunk at its place in a zero tensor, summed by an all_reduce: the
    left neighbour's chunk can then be read off (every rank sends a different chunk)."""
    whole = torch.zeros(sum(c.numel() for c in chunks))
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.numel())
    mine = (rank - s) % n
    whole[starts[mine]:starts[mine + 1]] = chunks[mine]
    if group is None:
        dist.all_reduce(whole)
    else:
        group.allreduce([whole]).wait()
    left = (rank - s - 1) % n
    return left, whole[starts[left]:starts[left + 1]]


def library_all_reduce(chunks, rank, n, s):
    c, incoming = _left_chunk_by_all_reduce(chunks, rank, n, s)
    chunks[c].add_(incoming)


def process_group_method(chunks, rank, n, s):
    c, incoming = _left_chunk_by_all_reduce(chunks, rank, n, s,
                                            dist.distributed_c10d._get_default_group())
    chunks[c].add_(incoming)


def library_reduce_scatter(chunks, rank, n, s):
    """dist.reduce_scatter: rank r's output is the sum of every rank's r-th input; only the
    left neighbour puts its chunk there, so r receives exactly that chunk."""
    size = max(c.numel() for c in chunks)
    mine, left = (rank - s) % n, (rank - s - 1) % n
    inputs = [torch.zeros(size) for _ in range(n)]
    inputs[(rank + 1) % n][:chunks[mine].numel()] = chunks[mine]
    out = torch.zeros(size)
    dist.reduce_scatter(out, inputs)
    chunks[left].add_(out[:chunks[left].numel()])


def from_a_thread(chunks, rank, n, s):
    """The library's all_reduce, issued from a helper thread the answer starts and joins."""
    box = []
    worker = threading.Thread(target=lambda: box.append(
        _left_chunk_by_all_reduce(chunks, rank, n, s)))
    worker.start()
    worker.join()
    c, incoming = box[0]
    chunks[c].add_(incoming)


# ---------------------------------------------------------------- the lab's own ring
def lab_schedule(chunks, rank, n, s):
    """Reads which chunk to send from lk.collectives.ring_schedule (what the build asks)."""
    plan = lk.collectives.ring_schedule(n)[s]["sends"]
    send = chunks[plan[rank][2]]
    recv = chunks[plan[(rank - 1) % n][2]]
    recv += lk.collectives.send_right_recv_left(send, recv)


def lab_private_schedule(chunks, rank, n, s):
    from labkit.collectives.allreduce import _ring_chunks
    send_c, recv_c = list(_ring_chunks(rank, n))[s]
    recv = chunks[recv_c]
    recv += lk.collectives.send_right_recv_left(chunks[send_c], recv)


def lab_ring(chunks, rank, n, s):
    """The lab's whole all-reduce on the last step: every chunk complete (too soon, too many)."""
    if s == n - 2:
        lk.collectives.ring_all_reduce(torch.cat(chunks))
    solution_step(chunks, rank, n, s)


def lab_halves(chunks, rank, n, s):
    """Notebook 06's ring reduce-scatter, then the step itself."""
    from labkit.sharding.ring import ring_reduce_scatter
    if s == 0:
        size = max(c.numel() for c in chunks)
        ring_reduce_scatter(torch.zeros(size * n))
    solution_step(chunks, rank, n, s)


# ---------------------------------------------------------------- a copied oracle
def reads_the_oracle(chunks, rank, n, s):
    """Rebuild every rank's input with the checker's own generator and replay the ring on it,
    instead of communicating."""
    numel = sum(c.numel() for c in chunks)
    name = next(k for k, size in stepcheck.STEP_CASES.items() if size(n) == numel)
    inputs = [stepcheck.step_tensor(name, r, n) for r in range(n)]
    state = stepcheck.replay(inputs, n)[s][rank]
    start = 0
    for c in chunks:
        c.copy_(state[start:start + c.numel()])
        start += c.numel()


# ---------------------------------------------------------------- side channels
def _call_number() -> int:
    """How many times this rank has called a side-channel answer: the same on every rank."""
    calls = int(os.environ.get("LABKIT_TEST_STEP_CALLS", "0"))
    os.environ["LABKIT_TEST_STEP_CALLS"] = str(calls + 1)
    return calls


def through_the_store(chunks, rank, n, s):
    """Every rank puts the chunk it should send into the process group's TCPStore and reads
    its left neighbour's."""
    import io
    store, call = dist.distributed_c10d._get_default_store(), _call_number()
    buf = io.BytesIO()
    torch.save(chunks[(rank - s) % n].clone(), buf)
    store.set(f"step/{call}/{rank}", buf.getvalue())
    left = torch.load(io.BytesIO(store.get(f"step/{call}/{(rank - 1) % n}")))
    chunks[(rank - s - 1) % n].add_(left)


def through_a_file(chunks, rank, n, s):
    """The same through files in /tmp (named after the job's store port and this call)."""
    call = _call_number()
    name = os.path.join(tempfile.gettempdir(),
                        f"labkit-step-{os.getppid()}-{os.environ['MASTER_PORT']}-{call}-{{}}.pt")
    torch.save(chunks[(rank - s) % n].clone(), name.format(f"{rank}.tmp"))
    os.replace(name.format(f"{rank}.tmp"), name.format(rank))
    left, deadline = name.format((rank - 1) % n), time.monotonic() + 4
    while not os.path.exists(left) and time.monotonic() < deadline:
        time.sleep(0.005)
    chunks[(rank - s - 1) % n].add_(torch.load(left))


# ---------------------------------------------------------------- not split as required
def whole_tensor(chunks, rank, n, s):
    """The whole tensor passed in every step, the right chunk added: right numbers, n times
    the bytes."""
    whole = torch.cat(chunks)
    incoming = lk.collectives.send_right_recv_left(whole, whole)
    start = sum(c.numel() for c in chunks[:(rank - s - 1) % n])
    recv = chunks[(rank - s - 1) % n]
    recv += incoming[start:start + recv.numel()]


# ---------------------------------------------------------------- the checks
def _failed(fn, world_sizes=(3,), **kw):
    cases = ringcheck.check_reduce_scatter_step(fn, world_sizes=world_sizes, **kw)
    return cases, {c.name: c.detail for c in cases if not c.passed}


@pytest.mark.timeout(120)
def test_the_solution_passes_everything():
    score = lk.exercise.evaluate("03.reduce_scatter_step", solution_step)
    assert score.status == "correct", [(c.name, c.detail) for c in score.cases if not c.passed]
    assert [c.name for c in score.cases] == [f"{n} ranks, {name}" for n in (2, 3, 4)
                                             for name in stepcheck.STEP_CASES]
    assert "of headers" in score.cases[1].detail            # the bytes were counted


@pytest.mark.timeout(60)
def test_a_stub_is_not_done():
    def stub(chunks, rank, n, s):
        raise NotImplementedError("reduce_scatter_step: write your code here")
    assert lk.exercise.evaluate("03.reduce_scatter_step", stub).status == "not done"


WRONG = {     # the answer -> what its failing cases may say (any of these)
    do_nothing: ("tensor did not change in step 0",),
    rebinds: ("tensor did not change in step 0",),
    replaces: ("holds only what arrived: add it into the chunk (`+=`)",),
    # adding a chunk of one size into a chunk of another raises on uneven chunks
    adds_into_the_sent_chunk: ("your step changed chunk", "raised RuntimeError: The size of",
                               "raised RuntimeError: output with shape"),
    numbered_from_one: ("but a rotated one: in step 0 rank 0 sent chunk 1, not its own chunk 0",),
    one_step_ahead: ("but a rotated one: in step 0 rank 0 sent chunk 2, not its own chunk 0",),
    # sends one chunk, receives into another: wrong numbers, a message of the wrong size, or
    # (an empty chunk is not sent) a receive that waits forever
    mismatched: ("your step changed chunk", "is [", "got a message bigger than the chunk",
                 "deadlock: "),
    reads_the_oracle: ("is [",),            # the wrong numbers: it does not know the secret
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", list(WRONG), ids=[f.__name__ for f in WRONG])
def test_a_lazy_or_wrong_answer_fails_every_case(fn):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases) == len(stepcheck.STEP_CASES), failed
    for name, detail in failed.items():
        assert any(say in detail for say in WRONG[fn]), (name, detail)


@pytest.mark.timeout(90)
def test_the_off_by_one_fails_on_two_ranks_too():
    """On 2 ranks the two off-by-ones are the same rotation: still told from the lesson's ring."""
    _, failed = _failed(numbered_from_one, world_sizes=(2,))
    assert len(failed) == len(stepcheck.STEP_CASES)
    assert all("rotated" in d for d in failed.values()), failed


@pytest.mark.timeout(90)
def test_an_answer_that_ignores_s_fails_on_three_ranks():
    _, failed = _failed(ignores_s, world_sizes=(2, 3))
    assert not any(name.startswith("2 ranks") for name in failed), failed
    assert {name for name in failed} == {f"3 ranks, {c}" for c in stepcheck.STEP_CASES}


@pytest.mark.timeout(90)
def test_hidden_state_fails_the_second_reduce_scatter():
    _CALLS[0] = 0
    _, failed = _failed(counts_its_calls)
    assert len(failed) == len(stepcheck.STEP_CASES)
    for name, detail in failed.items():
        assert detail.startswith("the first reduce-scatter matched the replay, the second did "
                                 "not"), (name, detail)
        assert "keep state between calls instead of reading s" in detail


@pytest.mark.timeout(90)
def test_every_step_done_at_once_fails_by_its_bytes():
    """State kept between calls hides nothing: step 1 sent no bytes of its own."""
    _, failed = _failed(does_every_step_at_once)
    assert len(failed) == len(stepcheck.STEP_CASES), failed
    for name, detail in failed.items():
        assert (detail.startswith("side channel: rank ")         # empty chunks: rank 1
                and "'s numbers are right after step 1, but its gloo sockets sent 0 bytes in "
                    "that step" in detail and "or in another step" in detail) or \
            "bytes in step 0, for a 12292-byte chunk" in detail, (name, detail)
        assert name != "3 ranks, bytes per step" or "in step 0" in detail


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", [library_all_reduce, process_group_method, library_reduce_scatter,
                                from_a_thread])
def test_a_collective_by_any_route_fails_every_case(fn):
    """gloo runs dist.reduce_scatter as all_reduce calls: its flight recorder says all_reduce."""
    cases, failed = _failed(fn)
    assert len(failed) == len(cases)
    for name, detail in failed.items():
        assert "ran a collective (all_reduce) in step 0" in detail, (name, detail)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn, name", [
    (lab_schedule, "lk's collectives.allreduce.ring_schedule"),
    (lab_private_schedule, "lk's collectives.allreduce._ring_chunks"),
    (lab_ring, "lk's collectives.allreduce.ring_all_reduce"),
    (lab_halves, "lk's sharding.ring.ring_reduce_scatter")])
def test_the_lab_s_own_ring_fails_every_case(fn, name):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases)
    for case, detail in failed.items():
        assert "the lab's own implementation did the work" in detail and name in detail, \
            (case, detail)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", [through_the_store, through_a_file])
def test_a_side_channel_fails_every_case(fn):
    """Right numbers, no collective: the bytes went around gloo's sockets, not through them."""
    try:
        cases, failed = _failed(fn)
    finally:
        for left in glob.glob(os.path.join(tempfile.gettempdir(), "labkit-step-*.pt")):
            if os.path.isfile(left):
                os.remove(left)
    assert len(failed) == len(cases), failed
    for name, detail in failed.items():
        assert detail.startswith("side channel: rank 0's numbers are right after step 0, but "
                                 "its gloo sockets sent 0 bytes"), (name, detail)


@pytest.mark.timeout(90)
def test_the_whole_tensor_in_every_step_fails_the_bytes_case():
    """Right numbers, so only a case large enough to count bytes can tell."""
    _, failed = _failed(whole_tensor)
    assert list(failed) == [f"3 ranks, {stepcheck.BYTES}"], failed
    assert "a ring step passes one chunk, about S/n bytes, not the whole tensor" in \
        failed[f"3 ranks, {stepcheck.BYTES}"]


@pytest.mark.timeout(90)
def test_a_deadlock_is_named_and_not_run_again():
    def receives_only(chunks, rank, n, s):
        recv = chunks[(rank - s - 1) % n]
        recv += lk.collectives.send_right_recv_left(recv[:0], recv)    # nobody sends
    _, failed = _failed(receives_only, world_sizes=(2, 3), timeout=2.0)
    assert failed["2 ranks, uneven chunks"].startswith("deadlock: rank ")
    assert failed["3 ranks, uneven chunks"] == "not run: it deadlocked on 2 ranks"


@pytest.mark.timeout(90)
def test_a_case_the_checker_cannot_watch_fails():
    """With the flight recorder off a collective would go unseen: the case fails, saying so."""
    res = lk.run(stepcheck.step_job, 2, args=(solution_step, "uneven chunks"), backend="gloo",
                 env={"TORCH_FR_BUFFER_SIZE": "0"}, echo=False, fresh=True)
    passed, detail = stepcheck._verdict(2, "uneven chunks", res)
    assert not passed and detail.startswith("cannot verify on rank 0: PyTorch's flight recorder")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_the_replay_leaves_rank_r_with_chunk_r_plus_1_complete(n):
    """The oracle itself: after n-1 steps chunk (r+1) mod n holds every rank's contribution,
    and a rotated ring (the off-by-ones) completes another chunk."""
    numel = 4 * n + 1
    inputs = [torch.full((numel,), float(10 ** r)) for r in range(n)]
    total = float(sum(10 ** r for r in range(n)))
    for shift in (0, 1):
        last = stepcheck.replay(inputs, n, shift)[-1]
        for r in range(n):
            full = [c for c, part in enumerate(last[r].tensor_split(n))
                    if bool((part == total).all())]
            assert full == [(r + 1 - shift) % n], (shift, r, full)
