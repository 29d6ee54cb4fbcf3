"""Notebook 09's exercise (09.ring_attention) cannot be passed without a ring and the
log-sum-exp merge.

Each lazy, wrong or shortcut answer below must fail a named case, with a detail that says why,
and the solution must pass everything. Most answers run on 3 ranks only (one fresh job: both
calls, not causal then causal); the ones whose flaw shows elsewhere say why. The classes of
shortcut, and the tests that feed them:

* a stub: "not done";
* lazy and wrong answers: ``own_block_only`` (no communication), ``returns_out_and_lse`` (a
  tuple), ``deadlocks`` (receives only: named, the larger world sizes not run);
* wrong merge (no LSE rescale): ``averages_the_blocks``, ``sums_the_blocks``;
* wrong causal mask (off by one block): ``diagonal_unmasked``, ``diagonal_left_out``,
  ``labels_the_block_r_plus_s`` (right when not causal, and on 2 ranks where r + s = r - s
  mod 2);
* hidden state: ``keeps_the_first_answer`` (the second call of the job shows it);
* gathering the whole sequence: ``all_gather_then_sdpa`` (a collective: the flight recorder),
  ``gathers_from_a_thread`` (the same from a helper thread), ``sends_to_every_rank`` (point to
  point, every block to every rank: the peers), ``passes_everything_so_far`` (a growing message
  every step: the bytes);
* attention on the full sequence via torch's SDPA after getting all K/V by a ring:
  ``ring_then_sdpa`` (right bytes and peers: the width of the attention product, 3 ranks up);
* the lab's own work: ``lab_ring`` (``SX.ring_attention``), ``lab_merge`` (``SX.merge_partials``
  in an otherwise right ring);
* a copied oracle with fixed seeds: ``copies_the_oracle``;
* side channels: ``through_the_store``, ``through_a_file``.

The checker is called directly (``09.ring_attention`` joins the bank when the notebook is
assembled); :func:`_evaluate` scores it as the grader does, from a Question built here.
"""
from __future__ import annotations

import glob
import io
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

import labkit as lk
from labkit.grading.bank import Question
from labkit.grading.exercise import evaluate
from labkit.sequences_experts import attention as A
from labkit.sequences_experts.check import ring as check

QUESTION = Question(id="09.ring_attention", kind="exercise", prompt="",
                    variable="ring_attention", points=4,
                    checker="labkit.sequences_experts.check.ring:check_ring_attention",
                    partial=True)
MERGE = "wrong merge (no log-sum-exp rescale)"
MASK = "wrong causal mask (off by one block)"
GATHER = "gathering the whole sequence"


def _evaluate(fn):
    return evaluate(QUESTION, fn)


def _failed(fn, world_sizes=(3,)):
    cases = check.check_ring_attention(fn, world_sizes=world_sizes)
    return cases, {c.name: c.detail for c in cases if not c.passed}


def solution(q, k, v, causal):
    """The notebook's solution."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])                        # one message per step: K and V together
    out = lse = None
    for s in range(n):
        if s < n - 1:                               # post the next transfer first: it overlaps
            incoming = torch.empty_like(kv)
            works = [dist.irecv(incoming, (rank - 1) % n), dist.isend(kv, (rank + 1) % n)]
        j = (rank - s) % n                          # the rank whose block this is
        if not causal or j <= rank:
            o, l = A.attention_lse(q, kv[0], kv[1], causal=causal and j == rank)
            if out is None:
                out, lse = o, l
            else:
                new = torch.logaddexp(lse, l)
                out = torch.exp(lse - new)[..., None] * out + torch.exp(l - new)[..., None] * o
                lse = new
        if s < n - 1:
            for w in works:
                w.wait()
            kv = incoming
    return out


def _ring(q, k, v, causal, merge, diagonal="mask", label=None):
    """A ring with a chosen merge, diagonal and block labelling (the mistakes below)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv, parts = torch.stack([k, v]), []
    for s in range(n):
        if s < n - 1:
            incoming = torch.empty_like(kv)
            works = [dist.irecv(incoming, (rank - 1) % n), dist.isend(kv, (rank + 1) % n)]
        j = (label or (lambda r, s, n: (r - s) % n))(rank, s, n)
        diag = causal and j == rank
        if (not causal or j <= rank) and not (diag and diagonal == "skip"):
            parts.append(A.attention_lse(q, kv[0], kv[1], causal=diag and diagonal == "mask"))
        if s < n - 1:
            for w in works:
                w.wait()
            kv = incoming
    return merge(parts) if parts else torch.zeros_like(q)


# ---------------------------------------------------------------- lazy and wrong answers
def own_block_only(q, k, v, causal):
    return A.attention_lse(q, k, v, causal=causal)[0]


def returns_out_and_lse(q, k, v, causal):
    return A.attention_lse(q, k, v, causal=causal)


def averages_the_blocks(q, k, v, causal):
    return _ring(q, k, v, causal, lambda parts: sum(o for o, _ in parts) / len(parts))


def sums_the_blocks(q, k, v, causal):
    return _ring(q, k, v, causal, lambda parts: sum(o for o, _ in parts))


def _lse_merge(parts):
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), 0)
    return sum(torch.exp(l - lse)[..., None] * o for o, l in parts)


def diagonal_unmasked(q, k, v, causal):
    return _ring(q, k, v, causal, _lse_merge, diagonal="full")


def diagonal_left_out(q, k, v, causal):
    return _ring(q, k, v, causal, _lse_merge, diagonal="skip")


def labels_the_block_r_plus_s(q, k, v, causal):
    return _ring(q, k, v, causal, _lse_merge, label=lambda r, s, n: (r + s) % n)


_KEPT: dict = {}


def keeps_the_first_answer(q, k, v, causal):
    """Computes once per process and hands the kept output back on every later call."""
    if "out" not in _KEPT:
        _KEPT["out"] = solution(q, k, v, causal)
    return _KEPT["out"]


# ---------------------------------------------------------------- gathering the whole sequence
def _full_attention(q, keys, values, causal):
    """q against every block at once, with torch's SDPA (rank r holds block r)."""
    import torch.nn.functional as F
    rank, block = dist.get_rank(), q.shape[-2]
    K, V = torch.cat(keys, -2), torch.cat(values, -2)
    mask = (torch.ones(block, K.shape[-2], dtype=torch.bool).tril(rank * block)
            if causal else None)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)


def all_gather_then_sdpa(q, k, v, causal):
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return _full_attention(q, ks, vs, causal)


def gathers_from_a_thread(q, k, v, causal):
    box = []
    worker = threading.Thread(target=lambda: box.append(all_gather_then_sdpa(q, k, v, causal)))
    worker.start()
    worker.join()
    return box[0]


def sends_to_every_rank(q, k, v, causal):
    """Every rank's K/V straight to every other rank, by isend/irecv: the same bytes as the
    ring, to the wrong peers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    got = {rank: kv}
    works = []
    for peer in range(n):
        if peer != rank:
            got[peer] = torch.empty_like(kv)
            works += [dist.irecv(got[peer], peer), dist.isend(kv, peer)]
    for w in works:
        w.wait()
    return _full_attention(q, [got[r][0] for r in range(n)], [got[r][1] for r in range(n)],
                           causal)


def ring_then_sdpa(q, k, v, causal):
    """Every block collected by a real ring (right peers, right bytes), then one SDPA call over
    the whole sequence."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv, held = torch.stack([k, v]), {}
    for s in range(n):
        held[(rank - s) % n] = kv
        if s < n - 1:
            kv = lk.collectives.send_right_recv_left(kv, kv)
    return _full_attention(q, [held[j][0] for j in range(n)], [held[j][1] for j in range(n)],
                           causal)


def passes_everything_so_far(q, k, v, causal):
    """Each step sends every block it has seen: right numbers, a growing message."""
    rank, n = dist.get_rank(), dist.get_world_size()
    seen = torch.stack([k, v])[None]                # [blocks, 2, H, B, D], newest last
    for s in range(1, n):
        incoming = torch.empty_like(seen)
        works = [dist.irecv(incoming, (rank - 1) % n), dist.isend(seen, (rank + 1) % n)]
        for w in works:
            w.wait()
        seen = torch.cat([seen, incoming[-1:]])     # the left neighbour's newest block is new
    parts = []
    for s, kv in enumerate(seen):
        j = (rank - s) % n
        if not causal or j <= rank:
            parts.append(A.attention_lse(q, kv[0], kv[1], causal=causal and j == rank))
    return _lse_merge(parts)


# ---------------------------------------------------------------- the lab's own work
def lab_ring(q, k, v, causal):
    return A.ring_attention(q, k, v, causal=causal)


def lab_merge(q, k, v, causal):
    rank, n = dist.get_rank(), dist.get_world_size()
    kv, acc = torch.stack([k, v]), None
    for s in range(n):
        j = (rank - s) % n
        if not causal or j <= rank:
            part = A.attention_lse(q, kv[0], kv[1], causal=causal and j == rank)
            acc = part if acc is None else A.merge_partials(*acc, *part)
        if s < n - 1:
            kv = lk.collectives.send_right_recv_left(kv, kv)
    return acc[0]


# ---------------------------------------------------------------- a copied oracle
def copies_the_oracle(q, k, v, causal):
    """Rebuilds every rank's inputs from a fixed seed and runs the oracle: no communication."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    blocks = [[torch.randn(q.shape, generator=g) for _ in range(3)] for _ in range(n)]
    blocks[rank] = [q, k, v]
    want = check.oracle_blocks(*[[b[i] for b in blocks] for i in range(3)], causal)
    return want[rank]


# ---------------------------------------------------------------- side channels
def _call_number() -> int:
    calls = int(os.environ.get("LABKIT_TEST_RING_CALLS", "0"))
    os.environ["LABKIT_TEST_RING_CALLS"] = str(calls + 1)
    return calls


def _blockwise(q, blocks, causal):
    """The right answer from every rank's (K, V), one block at a time (no wide product)."""
    rank = dist.get_rank()
    parts = [A.attention_lse(q, k, v, causal=causal and j == rank)
             for j, (k, v) in enumerate(blocks) if not causal or j <= rank]
    return _lse_merge(parts)


def through_the_store(q, k, v, causal):
    store, call = dist.distributed_c10d._get_default_store(), _call_number()
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = io.BytesIO()
    torch.save(torch.stack([k, v]), buf)
    store.set(f"ring/{call}/{rank}", buf.getvalue())
    blocks = [torch.load(io.BytesIO(store.get(f"ring/{call}/{j}"))) for j in range(n)]
    return _blockwise(q, blocks, causal)


def through_a_file(q, k, v, causal):
    call, rank, n = _call_number(), dist.get_rank(), dist.get_world_size()
    name = os.path.join(tempfile.gettempdir(),
                        f"labkit-ring-{os.getppid()}-{os.environ['MASTER_PORT']}-{call}-{{}}.pt")
    torch.save(torch.stack([k, v]), name.format(f"{rank}.tmp"))
    os.replace(name.format(f"{rank}.tmp"), name.format(rank))
    blocks = []
    for j in range(n):
        deadline = time.monotonic() + 4
        while not os.path.exists(name.format(j)) and time.monotonic() < deadline:
            time.sleep(0.005)
        blocks.append(torch.load(name.format(j)))
    return _blockwise(q, blocks, causal)


# ---------------------------------------------------------------- the checks
@pytest.mark.timeout(120)
def test_the_solution_passes_everything():
    score = _evaluate(solution)
    assert score.status == "correct", [(c.name, c.detail) for c in score.cases if not c.passed]
    assert [c.name for c in score.cases] == [f"{n} ranks, {c}" for n in (2, 3, 4)
                                             for c in ("not causal", "causal")]
    assert all("of the one-process oracle" in c.detail for c in score.cases)


@pytest.mark.timeout(60)
def test_a_stub_is_not_done():
    def stub(q, k, v, causal):
        raise NotImplementedError("ring_attention: write your code here")
    assert _evaluate(stub).status == "not done"


@pytest.mark.timeout(60)
def test_the_lab_s_own_ring_and_merge_fail_every_case():
    for fn, name in ((lab_ring, "sequences_experts.attention.ring_attention"),
                     (lab_merge, "sequences_experts.attention.merge_partials")):
        cases, failed = _failed(fn, world_sizes=(2,))
        assert len(failed) == len(cases) == 2
        for case, detail in failed.items():
            assert "the lab's own implementation did the work" in detail and name in detail, \
                (case, detail)


EVERY_CASE = {     # the answer -> what each of its (3-rank) cases must say
    own_block_only: "only this rank's own block of keys counts",
    returns_out_and_lse: "rank 0 returned tuple, not a tensor",
    averages_the_blocks: f"{MERGE}: your output is the plain average",
    sums_the_blocks: f"{MERGE}: your output is the sum",
    all_gather_then_sdpa: f"{GATHER}: rank 0 ran a collective (all_gather)",
    gathers_from_a_thread: f"{GATHER}: rank 0 ran a collective (all_gather)",
    sends_to_every_rank: f"{GATHER}: rank 0 received from rank 1",
    ring_then_sdpa: "attention over the whole sequence: rank 0 ran",
    through_the_store: "side channel: rank 0's output is right, but its gloo sockets sent 0",
    through_a_file: "side channel: rank 0's output is right, but its gloo sockets sent 0",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", list(EVERY_CASE), ids=[f.__name__ for f in EVERY_CASE])
def test_a_lazy_wrong_or_shortcut_answer_fails_every_case(fn):
    try:
        cases, failed = _failed(fn)
    finally:
        for left in glob.glob(os.path.join(tempfile.gettempdir(), "labkit-ring-*.pt")):
            os.remove(left)
    assert len(failed) == len(cases) == 2, failed
    for name, detail in failed.items():
        assert detail.startswith(EVERY_CASE[fn]), (name, detail)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, says", [
    (diagonal_unmasked, "diagonal block (this rank's own keys) was used unmasked"),
    (diagonal_left_out, "diagonal block (this rank's own keys) was left out"),
    (labels_the_block_r_plus_s, "treated it as rank (r + s) mod n's")],
    ids=["diagonal_unmasked", "diagonal_left_out", "labels_the_block_r_plus_s"])
def test_a_causal_mask_one_block_off_fails_the_causal_case(fn, says):
    """Right when not causal (every block counts whatever its label), wrong when causal."""
    _, failed = _failed(fn)
    assert list(failed) == ["3 ranks, causal"], failed
    assert failed["3 ranks, causal"].startswith(f"{MASK}: ") and says in \
        failed["3 ranks, causal"]


@pytest.mark.timeout(60)
def test_hidden_state_fails_the_second_call():
    _KEPT.clear()
    _, failed = _failed(keeps_the_first_answer, world_sizes=(2,))
    assert list(failed) == ["2 ranks, causal"], failed
    assert "'s output is off by up to" in failed["2 ranks, causal"]


@pytest.mark.timeout(60)
def test_a_growing_message_fails_by_its_bytes():
    _, failed = _failed(passes_everything_so_far)
    assert list(failed) == ["3 ranks, not causal", "3 ranks, causal"], failed
    for detail in failed.values():
        assert detail.startswith(f"{GATHER}: rank 0 sent 12,") and "more than a ring's N - 1 = 2 "\
            "K/V blocks of 4,096 bytes" in detail, detail


@pytest.mark.timeout(60)
def test_a_copied_oracle_computes_the_wrong_numbers():
    _, failed = _failed(copies_the_oracle, world_sizes=(2,))
    assert len(failed) == 2
    assert all("'s output is off by up to" in d for d in failed.values()), failed


@pytest.mark.timeout(60)
def test_a_deadlock_is_named_and_not_run_again():
    def receives_only(q, k, v, causal):
        incoming = torch.empty_like(k)
        dist.recv(incoming, (dist.get_rank() - 1) % dist.get_world_size())
        return q
    cases = check.check_ring_attention(receives_only, world_sizes=(2, 3), timeout=2.0)
    failed = {c.name: c.detail for c in cases if not c.passed}
    assert failed["2 ranks, not causal"].startswith("deadlock: rank "), failed
    assert failed["3 ranks, causal"] == "not run: the job on 2 ranks deadlocked"


def test_the_mistakes_differ_from_the_oracle_and_from_each_other():
    """The diagnosis is sound: on 3 ranks every simulated mistake is far from the oracle (so a
    right answer never matches one), and no two are confused."""
    g = torch.Generator().manual_seed(0)
    blocks = [[torch.randn(2, 16, 16, generator=g) for _ in range(3)] for _ in range(3)]
    qs, ks, vs = ([b[i] for b in blocks] for i in range(3))
    for causal in (False, True):
        want = check.oracle_blocks(qs, ks, vs, causal)
        wrong = check.mistakes(qs, ks, vs, causal)
        for name, got in wrong.items():
            gap = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert gap > 100 * check.TOLERANCE, (causal, name, gap)
        names = list(wrong)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                gap = max(float((x - y).abs().max()) for x, y in zip(wrong[a], wrong[b]))
                assert gap > 100 * check.TOLERANCE, (causal, a, b)
