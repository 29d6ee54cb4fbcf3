"""Hand-written all-reduce (labkit.collectives) against dist.all_reduce, and its traffic."""
from __future__ import annotations

import pytest
import torch

import labkit as lk
from labkit.collectives import check as _ringcheck
from labkit import collectives as C
from labkit.collectives import allreduce
from labkit.collectives.trace import RankTrace, Trace

ALGOS = {"ring": C.ring_all_reduce, "naive": C.naive_all_reduce}


# ---------------------------------------------------------------- pure logic, no processes
def _simulate(world_size: int, numel: int) -> list[list[float]]:
    """Play ring_schedule on plain lists: rank r starts with 10**r everywhere."""
    n = world_size
    bounds = [(int(c[0]), int(c[-1]) + 1) if len(c) else (0, 0)
              for c in torch.arange(numel).tensor_split(n)]
    data = [[float(10 ** r)] * numel for r in range(n)]
    for st in C.ring_schedule(n):
        msgs = [(src, dst, c, data[src][slice(*bounds[c])]) for src, dst, c in st["sends"]]
        for src, dst, c, vals in msgs:
            a, b = bounds[c]
            for i, v in zip(range(a, b), vals):
                data[dst][i] = data[dst][i] + v if st["phase"] == "reduce-scatter" else v
    return data


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_reduces_every_element_on_every_rank(n):
    total = float(sum(10 ** r for r in range(n)))
    assert _simulate(n, 2 * n + 1) == [[total] * (2 * n + 1)] * n
    assert len(C.ring_schedule(n)) == 2 * (n - 1)


def test_ring_schedule_matches_docstring():
    assert C.ring_schedule(3)[0] == {"step": 1, "phase": "reduce-scatter",
                                     "sends": [(0, 1, 0), (1, 2, 1), (2, 0, 2)]}


def test_a_wrong_schedule_would_be_caught():
    """The simulator is a real oracle: with one chunk index off, the sums come out wrong."""
    original = allreduce._ring_chunks
    allreduce._ring_chunks = lambda r, n: [((s + (i >= n - 1)) % n, c)       # all-gather one chunk off
                                   for i, (s, c) in enumerate(original(r, n))]
    try:
        assert _simulate(3, 6) != [[111.0] * 6] * 3
    finally:
        allreduce._ring_chunks = original


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_expected_traffic_matches_the_formulas(n):
    s = 4 * n * 4                                      # 4n float32 elements: divisible
    ring = C.expected_traffic("ring", 4 * n, n)
    assert all(r["sent"] == r["received"] == C.ring_bytes_per_rank(s, n) for r in ring)
    naive = C.expected_traffic("naive", 4 * n, n)
    assert naive[0]["sent"] == naive[0]["received"] == C.naive_master_bytes(s, n) == (n - 1) * s
    assert all(r["sent"] == s for r in naive[1:])


def test_expected_traffic_with_uneven_chunks():
    # 5 elements on 4 ranks: chunks of 2, 1, 1, 1 elements; rank r skips chunks r+1 and r+2
    rows = C.expected_traffic("ring", 5, 4, element_size=8)
    sizes = [16, 8, 8, 8]
    for r in rows:
        skip = sizes[(r["rank"] + 1) % 4] + sizes[(r["rank"] + 2) % 4]
        assert r["sent"] == 2 * 40 - skip
    with pytest.raises(ValueError, match="'ring' or 'naive'"):
        C.expected_traffic("tree", 5, 4)


def test_errors_outside_a_job_name_the_fix():
    with pytest.raises(RuntimeError, match="lk.run"):
        C.ring_all_reduce(torch.ones(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        C.naive_all_reduce([1.0, 2.0])


def test_trace_merge_names_the_bad_rank():
    with pytest.raises(TypeError, match="rank 1 returned float"):
        Trace([RankTrace(0, 2), 3.0])
    with pytest.raises(ValueError, match="one trace per rank"):
        Trace([RankTrace(1, 2), RankTrace(0, 2)])


# ---------------------------------------------------------------- real gloo jobs
def _compare(n, fn, names=None, op="sum", watch=False):
    res = lk.run(_ringcheck.compare_job, n, args=(fn, names or list(_ringcheck.CASES), op, watch),
                 backend="gloo", timeout=20, echo=False)
    return res.values


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", ["ring", "naive"])
def test_matches_dist_all_reduce_on_every_case(n, algo):
    for op in ("sum", "mean"):
        names = [c for c in _ringcheck.CASES if op == "sum" or c != "int64"]
        rows = _compare(n, ALGOS[algo], names, op)
        for r in range(n):
            assert [row["case"] for row in rows[r]] == names
            bad = [(row["case"], row["detail"]) for row in rows[r] if not row["ok"]]
            assert bad == [], f"rank {r}, op={op}: {bad}"
        for i, name in enumerate(names):                     # every rank holds the same bits
            assert len({rows[r][i]["digest"] for r in range(n)}) == 1, name


def _ring_equals_dist(rank: int, sizes) -> list[bool]:
    """For each (numel, dtype): the lab's ring and dist.all_reduce on this rank's integers
    (exact in any order), bit for bit."""
    import torch.distributed as dist

    from labkit.collectives import allreduce
    out = []
    for numel, dtype in sizes:
        gen = torch.Generator().manual_seed(rank + numel)
        x = torch.randint(1, 1000, (numel,), generator=gen).to(dtype)
        ours, ref = x.clone(), x.clone()
        allreduce.ring_all_reduce(ours)
        dist.all_reduce(ref)
        out.append(bool(torch.equal(ours, ref)))
    return out


def _scratch_job(rank, world_size):
    from labkit.collectives import allreduce
    kept, allreduce.KEEP_BYTES = allreduce.KEEP_BYTES, 64   # these sizes get the kept buffer
    try:
        out = _ring_equals_dist(rank, ((1001, torch.float32), (37, torch.float32),
                                       (4001, torch.float32), (50, torch.float64),
                                       (2001, torch.int64)))
        return out, sorted(str(k[1]) for k in allreduce._SCRATCH)
    finally:
        allreduce.KEEP_BYTES = kept                # the pool's ranks serve later tests
        allreduce._SCRATCH.clear()


@pytest.mark.timeout(60)
def test_the_kept_receive_buffer_serves_calls_of_every_size_and_dtype():
    """The reduce-scatter receives into a buffer kept between calls (per device and dtype):
    calls of growing, shrinking and other dtypes in a row still sum exactly."""
    res = lk.run(_scratch_job, 3, backend="gloo", timeout=30, echo=False)
    for ok, keys in res.values:          # earlier jobs in the same pool may have added keys
        assert ok == [True] * 5 and {"torch.float32", "torch.float64", "torch.int64"} <= set(keys)


SIZES = ((4099, torch.float32), (2003, torch.int64), (1024, torch.float64),
         (255, torch.float32), (383, torch.float32))   # the last two: neighbouring chunks on
                                                        # either side of a piece boundary


def _pieces_job(rank, world_size):
    import torch.distributed as dist

    from labkit.collectives import allreduce
    posted, real, kept = [], dist.irecv, allreduce.PIECE_BYTES

    def irecv(tensor, src, *args, **kwargs):   # dist.all_reduce posts none: the ring's only
        posted.append(tensor.numel() * tensor.element_size())
        return real(tensor, src, *args, **kwargs)
    allreduce.PIECE_BYTES, dist.irecv = 256, irecv   # chunks of 512 B or more arrive in pieces
    try:
        return _ring_equals_dist(rank, SIZES), posted
    finally:
        allreduce.PIECE_BYTES, dist.irecv = kept, real   # the pool's ranks serve later tests


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_a_large_chunk_is_received_in_pieces_and_still_sums_exactly(n):
    """From 2 * PIECE_BYTES a reduce-scatter chunk comes in pieces, each added as it lands:
    odd lengths and every dtype still give dist.all_reduce's result, also where a chunk and
    its neighbour (one element shorter) fall on either side of a piece boundary, so that
    sender and receiver must count the pieces of the chunk that travels; and the pieces were
    used: more receives than the ring's 2(N-1) per call, each piece at least PIECE_BYTES and
    under twice it, the all-gather's receives whole chunks."""
    res = lk.run(_pieces_job, n, backend="gloo", timeout=30, echo=False)
    chunks = {c.numel() * c.element_size() for numel, dtype in SIZES
              for c in torch.empty(numel, dtype=dtype).tensor_split(n)}   # whole chunks, bytes
    for ok, posted in res.values:
        assert ok == [True] * len(SIZES)
        assert len(posted) > len(SIZES) * 2 * (n - 1), posted
        pieces = [b for b in posted if b not in chunks]
        assert pieces and all(256 <= b < 512 for b in pieces), posted


def _two_rank_random(rank, world_size, algo):
    import torch.distributed as dist
    torch.manual_seed(rank)
    x = torch.randn(1001) * 1e3
    want = x.clone()
    dist.all_reduce(want)
    got = ALGOS[algo](x.clone())
    return bool(torch.equal(got, want)), bool(torch.equal(ALGOS[algo](x.clone(), "mean"),
                                                        want / world_size))


@pytest.mark.timeout(60)
def test_two_ranks_match_bit_for_bit_on_random_floats():
    for algo in ALGOS:
        res = lk.run(_two_rank_random, 2, args=(algo,), backend="gloo")
        assert res.values == [(True, True)] * 2


def _bad_calls(rank, world_size):
    out = []
    for call in (lambda: C.ring_all_reduce(torch.arange(4), "mean"),
                 lambda: C.naive_all_reduce(torch.ones(4), "max")):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(str(exc))
    x = torch.ones(3)
    assert C.ring_all_reduce(x, torch.distributed.ReduceOp.AVG) is x
    return out


@pytest.mark.timeout(60)
def test_bad_op_or_dtype_is_refused_before_any_message():
    out = lk.run(_bad_calls, 2, backend="gloo", echo=False).values[0]
    assert "convert first (t.float())" in out[0]
    assert "op='sum' or op='mean'" in out[1]


@pytest.mark.timeout(60)
def test_ring_trace_records_the_schedule_and_the_bytes():
    n, numel = 4, 8
    tr = C.record("ring", world_size=n, numel=numel, backend="gloo")
    assert tr.steps == 2 * (n - 1) and len(tr.frames) == tr.steps + 1
    assert len(tr.events) == 2 * n * tr.steps                 # a send and a recv per rank-step
    for plan in C.ring_schedule(n):
        sends = {(e.rank, e.peer, e.chunk) for e in tr.at(plan["step"], "send")}
        recvs = {(e.peer, e.rank, e.chunk) for e in tr.at(plan["step"], "recv")}
        assert sends == recvs == set(plan["sends"])
        assert {e.phase for e in tr.at(plan["step"])} == {plan["phase"]}
    assert tr.sent(2, step=3) == numel // n * 4
    assert all(row["ok"] and row["sent"] == row["formula"] for row in C.check_traffic(tr))
    # after reduce-scatter rank r holds the full sum of chunk r+1; after all-gather, everything
    for r in range(n):
        assert tr.frames[n - 1][r][(r + 1) % n] == [1111.0, 1111.0]
        assert tr.frames[-1][r] == [[1111.0, 1111.0]] * n
    assert tr.frames[0][2] == [[100.0, 100.0]] * n
    assert all(e.end is not None and e.end >= e.start >= 0 for e in tr.events)


@pytest.mark.timeout(60)
def test_traffic_check_catches_a_mismatch():
    tr = C.record("ring", world_size=3, numel=7, backend="gloo")   # uneven: 3, 2, 2 elements
    assert all(row["ok"] for row in C.check_traffic(tr))
    tr.events = [e for e in tr.events if not (e.rank == 1 and e.step == 2)]
    assert [row["ok"] for row in C.check_traffic(tr)] == [True, False, True]


@pytest.mark.timeout(60)
def test_naive_trace_moves_everything_through_rank_0():
    n, numel = 3, 6
    tr = C.record("naive", world_size=n, numel=numel, backend="gloo")
    s = numel * 4
    assert [row["sent"] for row in C.check_traffic(tr)] == [(n - 1) * s, s, s]
    assert all(row["ok"] for row in C.check_traffic(tr))
    assert {e.peer for e in tr.events if e.rank != 0} == {0}
    assert [e.phase for e in tr.at(1)] == ["reduce", "reduce"]
    assert tr.frames[n - 1][0] == [[111.0, 111.0]] * n         # master holds the sum
    assert tr.frames[n - 1][2] == [[100.0, 100.0]] * n         # others still their own


def learner_ring(tensor):
    """A ring as a learner writes it: plain isend/irecv on views, a temporary buffer."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        buf = torch.empty_like(chunks[(rank - s - 1) % n])
        reqs = [dist.isend(chunks[(rank - s) % n], right), dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        chunks[(rank - s - 1) % n] += buf
    for s in range(n - 1):
        reqs = [dist.isend(chunks[(rank + 1 - s) % n], dst=right),
                dist.irecv(chunks[(rank - s) % n], src=left)]
        for q in reqs:
            q.wait()


@pytest.mark.timeout(60)
def test_watching_a_learners_ring_gives_the_same_trace():
    ours = C.record("ring", world_size=3, numel=6, backend="gloo")
    theirs = C.record(learner_ring, world_size=3, numel=6, backend="gloo")
    assert theirs.frames == ours.frames
    def key(t):
        return sorted((e.step, e.rank, e.op, e.peer, e.chunk, e.bytes) for e in t.events)
    assert key(theirs) == key(ours)
    assert theirs.collectives == {}


def _watch_then_break(rank, world_size):
    import torch.distributed as dist
    before = (dist.isend, dist.all_reduce, dist.distributed_c10d.irecv)
    try:
        with C.tracing(torch.zeros(4)) as tr:
            dist.all_reduce(torch.ones(1))
            raise KeyError("boom")
    except KeyError:
        pass
    return before == (dist.isend, dist.all_reduce, dist.distributed_c10d.irecv), tr.collectives


@pytest.mark.timeout(60)
def test_tracing_restores_dist_and_lists_collectives():
    assert lk.run(_watch_then_break, 2, backend="gloo").values == [(True, ["all_reduce"])] * 2


# ---------------------------------------------------------------- the exercise checker
def solution_ring(tensor):
    """The notebook's solution: batched isend/irecv, any shape, contiguous or not."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    chunks = flat.tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv):
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        ops = [op for op in ops if op.tensor.numel()]
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()

    for step in range(n - 1):
        recv = chunks[(rank - step - 1) % n]
        buf = torch.empty_like(recv)
        exchange(chunks[(rank - step) % n], buf)
        recv += buf
    for step in range(n - 1):
        exchange(chunks[(rank + 1 - step) % n], chunks[(rank - step) % n])
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def floor_chunks_ring(tensor):
    """A classic bug: chunk = numel // n drops the remainder elements (no error on gloo)."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    size = flat.numel() // n
    chunks = [flat[i * size:(i + 1) * size] for i in range(n)]
    solution_like = [(rank - s) % n for s in range(n - 1)]
    for s, c in enumerate(solution_like):
        buf = torch.empty_like(chunks[(c - 1) % n])
        for q in [dist.isend(chunks[c], (rank + 1) % n), dist.irecv(buf, (rank - 1) % n)]:
            q.wait()
        chunks[(c - 1) % n] += buf
    for s in range(n - 1):
        for q in [dist.isend(chunks[(rank + 1 - s) % n], (rank + 1) % n),
                  dist.irecv(chunks[(rank - s) % n], (rank - 1) % n)]:
            q.wait()
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def stub(tensor):
    raise NotImplementedError("ring_all_reduce: write your code here")


def through_rank_0(tensor):
    """The naive all-reduce, written out: right, but rank 0 moves (N-1)·S bytes each way."""
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    total = tensor.contiguous().clone()                  # send and recv need contiguous memory
    if rank == 0:
        part = torch.empty_like(total)
        for src in range(1, n):
            dist.recv(part, src)
            total += part
        for dst in range(1, n):
            dist.send(total, dst)
    else:
        dist.send(total, 0)
        dist.recv(total, 0)
    tensor.copy_(total)


def cheat(tensor):
    torch.distributed.all_reduce(tensor)


def blocking_sends(tensor):
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    dist.send(tensor.contiguous(), (rank + 1) % n)      # every rank sends first: deadlock
    dist.recv(torch.empty_like(tensor), (rank - 1) % n)


@pytest.mark.timeout(120)
def test_checker_passes_a_correct_ring_and_animates_it():
    cases = C.check_ring_exercise(solution_ring)
    assert len(cases) == 3 * len(C.CASES) + 2
    assert [c.name for c in cases if not c.passed] == []
    assert cases[0].name == "2 ranks, divisible" and "matches dist.all_reduce" in cases[0].detail
    mine = C.record(solution_ring, world_size=4, numel=10, backend="gloo")
    ours = C.record("ring", world_size=4, numel=10, backend="gloo")
    assert mine.frames == ours.frames
    assert all(row["ok"] for row in C.check_traffic(mine))


@pytest.mark.timeout(120)
def test_checker_fails_exactly_the_wrong_cases():
    cases = {c.name: c for c in C.check_ring_exercise(floor_chunks_ring)}
    failed = sorted(name for name, c in cases.items() if not c.passed)
    for n in (2, 3, 4):
        assert f"{n} ranks, divisible" not in failed
        assert f"{n} ranks, not divisible" in failed
        assert f"{n} ranks, single element" in failed
    assert "elements differ" in cases["3 ranks, not divisible"].detail
    naive = [c.name for c in C.check_ring_exercise(through_rank_0) if not c.passed]
    assert naive == ["3 ranks, bytes sent per rank", "4 ranks, bytes sent per rank"]
    cheats = C.check_ring_exercise(cheat, world_sizes=(2,))
    assert not any(c.passed for c in cheats)
    assert "ran a collective (all_reduce)" in cheats[0].detail


@pytest.mark.timeout(120)
def test_checker_reports_a_stub_as_not_done():
    from labkit.grading.exercise import NotDone
    with pytest.raises(NotDone):
        C.check_ring_exercise(stub)
    score = lk.exercise.evaluate("03.ring_all_reduce", stub)
    assert score.status == "not done" and score.points == 0
    assert lk.exercise.evaluate("03.ring_all_reduce", solution_ring).status == "correct"


@pytest.mark.timeout(40)   # fast: 2 s collective timeouts, and larger world sizes skipped
def test_checker_fails_a_deadlock_fast_and_leaves_no_rank_behind():
    from conftest import assert_no_ranks_left
    cases = C.check_ring_exercise(blocking_sends, timeout=2.0)
    assert not any(c.passed for c in cases) and len(cases) == 3 * len(C.CASES) + 2
    assert cases[0].detail.startswith("deadlock: rank") and "matching receive" in cases[0].detail
    assert cases[-1].detail == "not run: the job on 2 ranks deadlocked"
    assert_no_ranks_left()


# ---------------------------------------------------------------- NCCL (GPU machines only)
from conftest import needs_gpus  # noqa: E402


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo", ["ring", "naive"])
def test_nccl_matches_dist_all_reduce(algo):
    res = lk.run(_ringcheck.compare_job, 2, args=(ALGOS[algo], list(_ringcheck.CASES)),
                 backend="nccl", timeout=60, echo=False)
    assert [row["case"] for row in res.values[0] if not row["ok"]] == []
    assert all(r["ok"] for r in C.check_traffic(C.record(algo, world_size=2, numel=9,
                                                          backend="nccl")))
    assert [c.name for c in C.check_ring_exercise(solution_ring, world_sizes=(2,))
            if not c.passed] == []
