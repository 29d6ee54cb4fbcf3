"""Notebook 09's exercise (09.moe_dispatch) cannot be passed without the two exchanges.

Each lazy, wrong or shortcut answer below must fail a named case, with a detail that says why,
and the solution must pass everything. Most answers run on 3 ranks only (one fresh job: every
scenario of the checker); the ones whose flaw shows elsewhere say why. The classes of
shortcut, and the tests that feed them:

* lazy and wrong answers: ``hands_back_the_tokens``, ``forgets_to_unsort`` (rows left in
  expert order), ``unsorts_the_wrong_way`` (``rows[order]`` instead of ``result[order] =
  rows``), ``assumes_it_receives_what_it_sends`` (no count exchange: output split sizes
  guessed), ``returns_early_when_nothing_came`` (a rank skips the exchanges: deadlock);
* every expert on every rank: ``own_experts_only`` (expert e read as local e % E/N: no token
  travels) and ``global_expert_index`` (asks its rank for another rank's expert: refused);
* the library doing the work the wrong way: ``all_gather_everything`` (every token to every
  rank by all_gather: the flight recorder), ``every_token_to_every_rank`` (by all_to_all, the
  experts run on all of them: more rows than routed) and ``every_token_sent_only_routed_run``
  (the same, experts on their own tokens only: the bytes case);
* the lab's own: ``lab_dispatch_combine``, ``lab_exchange_counts``;
* a copied oracle: ``copies_the_oracle`` (the checker's own generator with a fixed secret);
* side channels: ``through_the_store``, ``through_a_file``, ``gathers_in_a_thread``;
* a stub: "not done".

The checker is called directly (``09.moe_dispatch`` joins the bank when the notebook is
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

from labkit.grading.bank import Question
from labkit.grading.exercise import evaluate
from labkit.sequences_experts import experts as moe
from labkit.sequences_experts.check import experts as check

QUESTION = Question(id="09.moe_dispatch", kind="exercise", prompt="", variable="dispatch_combine",
                    points=4, checker="labkit.sequences_experts.check.experts:check_moe_dispatch",
                    partial=True)


def _evaluate(fn):
    return evaluate(QUESTION, fn)


def solution(tokens, expert_of_token, experts_per_rank, expert_fn):
    """The notebook's solution: its exchanges (:func:`_exchange`), then the unsort."""
    back, order = _exchange(tokens, expert_of_token, experts_per_rank, expert_fn)
    result = torch.empty_like(tokens)
    result[order] = back
    return result


def _exchange(tokens, expert_of_token, experts_per_rank, expert_fn, recv_sizes=None,
              early=False):
    """The solution's steps, returning (rows in expert order, order): wrong answers reuse it."""
    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    per_expert = torch.bincount(expert_of_token, minlength=n * experts_per_rank)
    send = per_expert.view(n, -1).sum(1).tolist()
    if recv_sizes is None:
        from_each = torch.empty_like(per_expert)
        dist.all_to_all_single(from_each, per_expert)
    else:                                   # guessed: "I receive what I send"
        from_each = per_expert.clone()
    recv = from_each.view(n, -1).sum(1).tolist()
    if early and sum(recv) == 0:
        return None, order
    got = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(got, tokens[order], recv, send)
    local = torch.arange(experts_per_rank).repeat(n).repeat_interleave(from_each)
    out = torch.zeros_like(got)
    for j in range(experts_per_rank):
        out[local == j] = expert_fn(j, got[local == j])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, out, send, recv)
    return back, order


# ---------------------------------------------------------------- lazy and wrong answers
def hands_back_the_tokens(tokens, expert_of_token, experts_per_rank, expert_fn):
    return tokens


def forgets_to_unsort(tokens, expert_of_token, experts_per_rank, expert_fn):
    return _exchange(tokens, expert_of_token, experts_per_rank, expert_fn)[0]


def unsorts_the_wrong_way(tokens, expert_of_token, experts_per_rank, expert_fn):
    back, order = _exchange(tokens, expert_of_token, experts_per_rank, expert_fn)
    return back[order]


def assumes_it_receives_what_it_sends(tokens, expert_of_token, experts_per_rank, expert_fn):
    back, order = _exchange(tokens, expert_of_token, experts_per_rank, expert_fn,
                            recv_sizes="guess")
    result = torch.empty_like(tokens)
    result[order] = back
    return result


def returns_early_when_nothing_came(tokens, expert_of_token, experts_per_rank, expert_fn):
    back, order = _exchange(tokens, expert_of_token, experts_per_rank, expert_fn, early=True)
    if back is None:
        return torch.zeros_like(tokens)
    result = torch.empty_like(tokens)
    result[order] = back
    return result


# ---------------------------------------------------------------- every expert on every rank
def own_experts_only(tokens, expert_of_token, experts_per_rank, expert_fn):
    """Every token through this rank's expert with the same local index: nothing travels."""
    out = torch.empty_like(tokens)
    for t, e in enumerate(expert_of_token.tolist()):
        out[t] = expert_fn(e % experts_per_rank, tokens[t:t + 1])[0]
    return out


def global_expert_index(tokens, expert_of_token, experts_per_rank, expert_fn):
    """Asks this rank's expert_fn for each token's (global) expert."""
    out = torch.empty_like(tokens)
    for t, e in enumerate(expert_of_token.tolist()):
        out[t] = expert_fn(e, tokens[t:t + 1])[0]
    return out


# ---------------------------------------------------------------- every token, everywhere
def _run_mine(all_tokens, all_experts, experts_per_rank, expert_fn, only_routed=True):
    """This rank's experts on the tokens routed to them (or on every token)."""
    rank = dist.get_rank()
    out = torch.zeros_like(all_tokens)
    for j in range(experts_per_rank):
        sel = all_experts == rank * experts_per_rank + j
        if only_routed:
            out[sel] = expert_fn(j, all_tokens[sel])
        else:
            out[sel] = expert_fn(j, all_tokens)[sel]
    return out


def all_gather_everything(tokens, expert_of_token, experts_per_rank, expert_fn):
    """all_gather every rank's tokens and routing, run the local experts, all_gather back."""
    n, rank = dist.get_world_size(), dist.get_rank()
    pieces = [None] * n
    dist.all_gather_object(pieces, (tokens, expert_of_token))
    results = [_run_mine(t, e, experts_per_rank, expert_fn) for t, e in pieces]
    back = [None] * n
    dist.all_gather_object(back, results)
    return sum(b[rank] for b in back)


def _everything_by_all_to_all(tokens, expert_of_token, experts_per_rank, expert_fn,
                              only_routed):
    """Every token to every rank by all_to_all_single (even splits), the results back."""
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = torch.tensor([tokens.shape[0]] * n)
    theirs = torch.empty_like(sizes)
    dist.all_to_all_single(theirs, sizes)
    got = tokens.new_empty((int(theirs.sum()), tokens.shape[1]))
    dist.all_to_all_single(got, tokens.repeat(n, 1), theirs.tolist(), sizes.tolist())
    ids = expert_of_token.new_empty(int(theirs.sum()))
    dist.all_to_all_single(ids, expert_of_token.repeat(n), theirs.tolist(), sizes.tolist())
    out = _run_mine(got, ids, experts_per_rank, expert_fn, only_routed)
    # send back only the rows of tokens routed here, so the combine is honest
    mine = (ids // experts_per_rank) == rank
    per_source = [int(m.sum()) for m in mine.split(theirs.tolist())]
    counts = torch.tensor(per_source)
    come = torch.empty_like(counts)
    dist.all_to_all_single(come, counts)
    back = tokens.new_empty((int(come.sum()), tokens.shape[1]))
    dist.all_to_all_single(back, out[mine], come.tolist(), per_source)
    result = torch.empty_like(tokens)
    for s, rows in enumerate(back.split(come.tolist())):
        result[expert_of_token // experts_per_rank == s] = rows
    return result


def every_token_to_every_rank(tokens, expert_of_token, experts_per_rank, expert_fn):
    return _everything_by_all_to_all(tokens, expert_of_token, experts_per_rank, expert_fn,
                                     only_routed=False)


def every_token_sent_only_routed_run(tokens, expert_of_token, experts_per_rank, expert_fn):
    return _everything_by_all_to_all(tokens, expert_of_token, experts_per_rank, expert_fn,
                                     only_routed=True)


# ---------------------------------------------------------------- the lab's own
def lab_dispatch_combine(tokens, expert_of_token, experts_per_rank, expert_fn):
    return moe.dispatch_combine(tokens, expert_of_token, experts_per_rank, expert_fn)


def lab_exchange_counts(tokens, expert_of_token, experts_per_rank, expert_fn):
    """The lab's count exchange, the rest by hand."""
    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    per_expert = torch.bincount(expert_of_token, minlength=n * experts_per_rank)
    from_each = moe.exchange_counts(per_expert, n)
    send = per_expert.view(n, -1).sum(1).tolist()
    recv = from_each.sum(1).tolist()
    got = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(got, tokens[order], recv, send)
    local = torch.arange(experts_per_rank).repeat(n).repeat_interleave(from_each.reshape(-1))
    out = torch.empty_like(got)
    for j in range(experts_per_rank):
        out[local == j] = expert_fn(j, got[local == j])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, out, send, recv)
    result = torch.empty_like(tokens)
    result[order] = back
    return result


# ---------------------------------------------------------------- a copied oracle
def copies_the_oracle(tokens, expert_of_token, experts_per_rank, expert_fn):
    """Rebuild every rank's experts with the checker's own generator (secret 0) and compute
    every output here, without communicating."""
    n, rank = dist.get_world_size(), dist.get_rank()
    name = next(k for k, sc in check.SCENARIOS.items()
                if sc["epr"] == experts_per_rank and sc["d"] == tokens.shape[1]
                and sc["tokens"](rank, n) == tokens.shape[0])
    data = [check.scenario(name, r, n, 0) for r in range(n)]
    out = torch.empty_like(tokens)
    for t, e in enumerate(expert_of_token.tolist()):
        out[t] = check.expert_rows(data[e // experts_per_rank]["weights"][e % experts_per_rank],
                                   tokens[t:t + 1])[0]
    return out


# ---------------------------------------------------------------- side channels
def _call_number() -> int:
    calls = int(os.environ.get("LABKIT_TEST_MOE_CALLS", "0"))
    os.environ["LABKIT_TEST_MOE_CALLS"] = str(calls + 1)
    return calls


def _by_side_channel(tokens, expert_of_token, experts_per_rank, expert_fn, put, get):
    """Every rank publishes its tokens; each runs its experts on what is routed to it and
    publishes the results; each reads its own back. No byte through gloo."""
    n, rank, call = dist.get_world_size(), dist.get_rank(), _call_number()
    put(f"{call}-in-{rank}", (tokens, expert_of_token))
    for s in range(n):
        tk, ex = get(f"{call}-in-{s}")
        put(f"{call}-out-{s}-{rank}", _run_mine(tk, ex, experts_per_rank, expert_fn))
    return sum(get(f"{call}-out-{rank}-{o}") for o in range(n))


def through_the_store(tokens, expert_of_token, experts_per_rank, expert_fn):
    store = dist.distributed_c10d._get_default_store()

    def put(key, obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        store.set(f"moe-test/{key}", buf.getvalue())

    def get(key):
        return torch.load(io.BytesIO(store.get(f"moe-test/{key}")))

    return _by_side_channel(tokens, expert_of_token, experts_per_rank, expert_fn, put, get)


def through_a_file(tokens, expert_of_token, experts_per_rank, expert_fn):
    base = os.path.join(tempfile.gettempdir(),
                        f"labkit-moe-{os.getppid()}-{os.environ['MASTER_PORT']}-{{}}.pt")

    def put(key, obj):
        torch.save(obj, base.format(f"{key}.tmp"))
        os.replace(base.format(f"{key}.tmp"), base.format(key))

    def get(key):
        deadline = time.monotonic() + 4
        while not os.path.exists(base.format(key)) and time.monotonic() < deadline:
            time.sleep(0.005)
        return torch.load(base.format(key))

    return _by_side_channel(tokens, expert_of_token, experts_per_rank, expert_fn, put, get)


def gathers_in_a_thread(tokens, expert_of_token, experts_per_rank, expert_fn):
    box = []
    worker = threading.Thread(target=lambda: box.append(
        all_gather_everything(tokens, expert_of_token, experts_per_rank, expert_fn)))
    worker.start()
    worker.join()
    return box[0]


# ---------------------------------------------------------------- the checks
def _failed(fn, world_sizes=(3,), **kw):
    cases = check.check_moe_dispatch(fn, world_sizes=world_sizes, **kw)
    return cases, {c.name: c.detail for c in cases if not c.passed}


@pytest.mark.timeout(120)
def test_the_solution_and_the_lab_s_own_pass_everything():
    score = _evaluate(solution)
    assert score.status == "correct", [(c.name, c.detail) for c in score.cases if not c.passed]
    assert [c.name for c in score.cases] == [f"{n} ranks, {name}" for n in (2, 3, 4)
                                             for name in check.SCENARIOS]
    assert all("of counts and framing" in c.detail for c in score.cases
               if c.name.endswith(check.BYTES))


@pytest.mark.timeout(60)
def test_a_stub_is_not_done():
    def stub(tokens, expert_of_token, experts_per_rank, expert_fn):
        raise NotImplementedError("dispatch_combine: write your code here")
    score = _evaluate(stub)
    assert score.status == "not done" and "not done yet" in score.feedback


WRONG = {     # the answer -> what each of its failing cases must say (any of these)
    hands_back_the_tokens: ("returned its tokens unchanged: no expert ran on them",),
    forgets_to_unsort: ("rows are right but in expert order, not token order",),
    unsorts_the_wrong_way: ("the right rows in the wrong order",),
    own_experts_only: ("its own experts run on its own tokens", "no token travelled"),
    copies_the_oracle: ("(routed to expert",),
    all_gather_everything: ("ran all_gather while your function ran",),
    gathers_in_a_thread: ("ran all_gather while your function ran",),
    every_token_to_every_rank: ("rows, and", "tokens were routed to it: experts ran on tokens "
                                             "not routed to them"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", list(WRONG), ids=[f.__name__ for f in WRONG])
def test_a_lazy_wrong_or_shortcut_answer_fails_every_case(fn):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases) == len(check.SCENARIOS), failed
    for name, detail in failed.items():
        assert any(say in detail for say in WRONG[fn]), (name, detail)


@pytest.mark.timeout(90)
def test_asking_for_another_rank_s_expert_is_refused():
    """A rank's expert_fn holds its own experts only: the rank raises, the job ends there."""
    _, failed = _failed(global_expert_index)
    first = failed.pop("3 ranks, uneven routing")
    assert "holds experts" in first and "the weights of every other expert live on its own " \
                                        "rank" in first, first
    assert set(failed.values()) == {"not run: the job stopped at scenario 'uneven routing'"}


@pytest.mark.timeout(90)
def test_no_count_exchange_fails_where_the_routing_is_uneven():
    """Guessing "I receive what I send": gloo aborts the rank given more rows than it made
    room for, or the rows land in the wrong places; the first scenario says which."""
    cases, failed = _failed(assumes_it_receives_what_it_sends)
    first = failed["3 ranks, uneven routing"]
    assert ("received more rows from a peer than its output_split_sizes had room for" in first
            and "exchange the counts first" in first) or "(routed to expert" in first, first


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn, name", [
    (lab_dispatch_combine, "lk's sequences_experts.experts.dispatch_combine"),
    (lab_exchange_counts, "lk's sequences_experts.experts.exchange_counts")])
def test_the_lab_s_own_dispatch_fails_every_case(fn, name):
    cases, failed = _failed(fn)
    assert len(failed) == len(cases)
    for case, detail in failed.items():
        assert "the lab's own implementation did the work" in detail and name in detail, \
            (case, detail)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn", [through_the_store, through_a_file])
def test_a_side_channel_fails_every_case(fn):
    """Right outputs, no collective: the rows went around gloo's sockets."""
    try:
        cases, failed = _failed(fn)
    finally:
        for left in glob.glob(os.path.join(tempfile.gettempdir(), "labkit-moe-*.pt*")):
            if os.path.isfile(left):
                os.remove(left)
    assert len(failed) == len(cases), failed
    for name, detail in failed.items():
        assert detail.startswith("side channel: rank ") and "fewer than the" in detail, \
            (name, detail)


@pytest.mark.timeout(90)
def test_every_token_to_every_rank_fails_the_bytes_case():
    """Experts run only on their own tokens, right outputs: only counted bytes can tell."""
    _, failed = _failed(every_token_sent_only_routed_run)
    assert list(failed) == [f"3 ranks, {check.BYTES}"], failed
    assert "it sent tokens nobody needed" in failed[f"3 ranks, {check.BYTES}"]


@pytest.mark.timeout(90)
def test_a_rank_that_skips_the_exchanges_deadlocks_named_and_not_run_again():
    _, failed = _failed(returns_early_when_nothing_came, world_sizes=(2, 3), timeout=2.0)
    assert set(failed) == {"2 ranks, a rank receives nothing"} | {
        f"3 ranks, {name}" for name in check.SCENARIOS}, failed
    assert failed["2 ranks, a rank receives nothing"].startswith("deadlock: rank 0 ")
    assert failed["3 ranks, uneven routing"] == "not run: the job on 2 ranks deadlocked"


@pytest.mark.timeout(60)
def test_a_case_the_checker_cannot_watch_fails():
    """With the flight recorder off an all_gather would go unseen: the case fails, saying so."""
    import labkit as lk
    res = lk.run(check.dispatch_job, 2, args=(solution, ["uneven routing"]), backend="gloo",
                 env={"TORCH_FR_BUFFER_SIZE": "0"}, echo=False, fresh=True)
    rows = [res[r].value for r in range(2)]
    passed, detail = check._verdict(2, "uneven routing", ["uneven routing"], rows, res)
    assert not passed and detail.startswith("cannot verify on rank 0: PyTorch's flight recorder")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_scenarios_are_what_their_names_say(n):
    """The oracle's inputs: uneven, a rank sending nothing to rank 1, rank n-1 receiving
    nothing, never already sorted where two experts are allowed."""
    for name, sc in check.SCENARIOS.items():
        data = [check.scenario(name, r, n, secret=12345) for r in range(n)]
        epr = sc["epr"]
        dest = [(d["experts"] // epr).tolist() for d in data]
        if name == "a rank sends nothing to another":
            assert 1 not in dest[0]
        if name == "a rank receives nothing":
            assert all(n - 1 not in d for d in dest)
        if name == "uneven routing":
            assert len({len(d) for d in dest}) == n
        for r, d in enumerate(data):
            e = d["experts"]
            if len(check._allowed(sc["route"], r, n, epr)) > 1 and len(e) > 1:
                assert not bool((e[1:] >= e[:-1]).all()), (name, r, e)   # unsorting matters
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in
                   zip(data, [check.scenario(name, r, n, secret=12345) for r in range(n)]))
