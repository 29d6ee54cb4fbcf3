"""Claim tests for notebook 09's experts sections (§8-§11): each reproduces, on the pinned torch
2.13.0 and gloo, a sentence the notebook says about torch or gloo. The docstring names the
section and quotes the sentence (``09 "§N": “...”``); the last test checks that every quoted
sentence is still in solutions/09_*.ipynb. When one fails after a torch upgrade, the sentence is
wrong for the new version: fix the prose, then the test.

Most claims run in one 2-rank gloo job (:func:`_a2a_facts`) shared by several tests; the
mismatched split sizes need jobs of their own (one of them ends with gloo aborting a rank).
"""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import cloudpickle
import pytest
import torch

import _claims
import labkit as lk

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _a2a_job(rank, world_size):
    """Uneven and empty splits, bytes on gloo's sockets per call, autograd, the recorder's name."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dfn

    from labkit.grading.watch import Watch, last_record_id, recorded_collectives
    watch = Watch()
    facts = {}
    send = [1, 3] if rank == 0 else [2, 0]                   # uneven, and an empty piece
    rows = torch.arange(sum(send) * 2.0).view(-1, 2) + 100 * rank
    counts, recv = torch.tensor(send), torch.empty(2, dtype=torch.int64)
    dist.all_to_all_single(recv, counts)
    out = torch.empty(int(recv.sum()), 2)
    mark = last_record_id()
    dist.all_to_all_single(out, rows, recv.tolist(), send)
    facts["recorded"] = recorded_collectives(mark)
    facts["recv"], facts["out"] = recv.tolist(), out.tolist()
    framing = {}
    for n_rows in (0, 1, 1000, 40000):                       # 0 B .. 160 KB per message
        x = torch.ones(2 * n_rows, 1)
        y = torch.empty(2 * n_rows, 1)
        watch.start()
        dist.all_to_all_single(y, x, [n_rows, n_rows], [n_rows, n_rows])
        framing[n_rows] = watch.stop()["sent"] - 4 * n_rows  # minus the piece for the other rank
    facts["framing"] = framing
    x = torch.ones(2, 3, requires_grad=True)
    y = torch.empty(2, 3)
    dist.all_to_all_single(y, x * 2)
    facts["dist_grad"] = (y.requires_grad, y.grad_fn is not None)
    z = dfn.all_to_all_single(torch.empty(2, 3), x * 2, None, None)
    z.sum().backward()
    facts["functional_grad"] = (z.requires_grad, x.grad.tolist())
    return facts


@lru_cache(maxsize=1)
def _a2a_facts():
    return lk.run(_a2a_job, 2, timeout=60, echo=False).values


def _mismatch_job(rank, world_size, expect):
    """Rank 0 sends 2 rows to rank 1; rank 1 makes room for ``expect``."""
    import torch.distributed as dist
    recv = [2, 2] if rank == 0 else [expect, 2]
    out = torch.full((sum(recv), 3), -1.0)
    dist.all_to_all_single(out, torch.ones(4, 3) * (rank + 1), recv, [2, 2])
    return out.tolist()


def test_all_to_all_single_takes_uneven_and_empty_pieces_in_rank_order():
    """09 "§9": “cuts `input` along its first dimension into N pieces of `input_split_sizes`
    rows, sends piece s to rank s, and fills `output` with the piece each rank sent here, in
    rank order, in pieces of `output_split_sizes`. The pieces may be uneven, and empty.”
    09 "§9": “Rank 1 sent nothing to itself and still took part in both calls”."""
    r0, r1 = _a2a_facts()
    assert r0["recv"] == [1, 2] and r0["out"] == [[0.0, 1.0], [100.0, 101.0], [102.0, 103.0]]
    assert r1["recv"] == [3, 0] and r1["out"] == [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_gloo_sends_a_framed_message_to_every_other_rank_even_an_empty_one():
    """09 "§9": “On gloo each all-to-all sends one message to every other rank, even an empty
    one, with 144 bytes of framing each.”"""
    for facts in _a2a_facts():
        assert facts["framing"] == {0: 144, 1: 144, 1000: 144, 40000: 144}, facts["framing"]


def test_dist_all_to_all_single_records_nothing_for_autograd():
    """09 "§9": “`dist.all_to_all_single` records nothing for autograd, so the layer wraps it in
    an autograd function whose backward is the same exchange with the split sizes swapped
    (PyTorch's differentiable version is `torch.distributed.nn.functional.all_to_all_single`).”"""
    for facts in _a2a_facts():
        assert facts["dist_grad"] == (False, False)
        requires, grad = facts["functional_grad"]
        assert requires and grad == [[2.0] * 3, [2.0] * 3]   # d(sum of 2x, exchanged)/dx


def test_the_flight_recorder_names_all_to_all_single_all_to_all():
    """09 "§10": “no collective but all-to-all may run”: the checker reads gloo's flight
    recorder, which lists `dist.all_to_all_single` as ``gloo:all_to_all``."""
    for facts in _a2a_facts():
        assert facts["recorded"] == ["gloo:all_to_all"]


def test_too_many_rows_abort_the_receiver_too_few_leave_the_rest_untouched():
    """09 "§9": “a rank given more rows than its `output_split_sizes` made room for is aborted
    ("Received data size doesn't match expected size"), but a rank given fewer keeps whatever
    its output tensor held in the rest of that piece, without an error.”"""
    small = lk.run(_mismatch_job, 2, args=(1,), timeout=10, echo=False, check=False, fresh=True)
    # rank 0 may finish, or lose its peer first: a race, so only rank 1 is asserted
    assert small[1].status == "signaled" and small[1].signal == "SIGABRT"
    assert "Received data size doesn't match expected size" in small[1].stderr
    large = lk.run(_mismatch_job, 2, args=(3,), timeout=10, echo=False, check=False, fresh=True)
    assert large.ok
    assert large[1].value == [[1.0] * 3, [1.0] * 3, [-1.0] * 3, [2.0] * 3, [2.0] * 3]


def test_a_stable_argsort_keeps_token_order_within_an_expert():
    """09 "§10": “`stable=True` keeps token order within an expert”."""
    experts = torch.tensor([2, 0, 1, 0, 2, 1, 0] * 50)
    order = torch.argsort(experts, stable=True)
    for e in range(3):
        mine = order[experts[order] == e]
        assert bool((mine[1:] > mine[:-1]).all())


def test_the_lab_says_what_these_tests_show():
    if not list((ROOT / "solutions").glob("09_*.ipynb")):
        pytest.skip("notebook 09 is not assembled yet (solutions/09_*.ipynb)")
    _claims.check_quotes(sys.modules[__name__])
