"""The DDP exercises (02.average_gradients, 02.overlap_ddp) cannot be passed without doing them.

Each lazy or wrong answer must fail a named case with a detail that says why; the notebook's
solutions must still pass. Before this test the wrapper checker seeded every rank alike, so a
wrapper that never broadcast rank 0's weights passed, and a token async all-reduce during
backward counted as overlap. The classes of shortcut, and the answers that feed them:

* hidden state: ``reads_the_oracle`` (its step count in a default argument); for the wrapper
  ``DecoyOverlap`` (a zero tensor kept in a closure is what overlaps, the real averaging comes
  after backward);
* the library doing the work: ``TorchDDPInside``, and ``TorchDDPBehindDecoys`` (torch's DDP
  hidden in a closure, decoy all-reduces during backward); the lab's own: ``lab_average``
  (``lk.ddp.average_gradients``), ``NaiveDDP`` and an overlapping ``BucketedDDP``;
* a copied oracle: ``reads_the_oracle`` (the checker's own oracle module), and
  ``ReadsTheOracle`` for the wrapper;
* a side channel: ``through_the_store`` (the gradients averaged through the process group's
  TCPStore), ``StoreBehindDecoys``; a collective issued from another thread is still the
  collective (the spy patches ``dist.all_reduce`` for every thread);
* a computation not split as required: n.a.: the split is the data, and each rank's batch is a
  secret of its own, so no rank can compute on another's.
"""
from __future__ import annotations

import io
import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.ddp import BucketedDDP, NaiveDDP, ReplicatedModule
from labkit.ddp.check import check_average_gradients, check_ddp_wrapper

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks cannot import this file

pytestmark = pytest.mark.timeout(90)


# ---------------------------------------------------------------- average_gradients
def solution(model):                      # the notebook's solution
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def reads_the_oracle(model, _step=[0]):
    """Copy the checker's own oracle into .grad: no communication at all."""
    from labkit.ddp.check import oracle_history
    want = oracle_history(dist.get_world_size())[_step[0] % 3]["grads"]
    _step[0] += 1
    for name, p in model.named_parameters():
        if want[name] is not None:
            p.grad = want[name].clone()


def averages_a_copy(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad / dist.get_world_size())    # the result goes nowhere


def first_parameter_only(model):
    p = next(p for p in model.parameters() if p.grad is not None)
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


def divides_by_two(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2                                        # right on 2 ranks only


def _store_average(tensors):
    """Average ``tensors`` over the ranks through the process group's TCPStore: no collective."""
    store, n, me = dist.distributed_c10d._get_default_store(), dist.get_world_size(), \
        dist.get_rank()
    call = int(os.environ.get("LABKIT_TEST_SIDE_CALLS", "0"))
    os.environ["LABKIT_TEST_SIDE_CALLS"] = str(call + 1)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    store.set(f"side/{call}/{me}", buf.getvalue())
    every = [torch.load(io.BytesIO(store.get(f"side/{call}/{r}"))) for r in range(n)]
    for i, t in enumerate(tensors):
        t.copy_(sum(e[i] for e in every) / n)


def through_the_store(model):
    _store_average([p.grad for p in model.parameters() if p.grad is not None])


def lab_average(model):
    """The lab's own reference, under another name."""
    from labkit.ddp import average_gradients as mine
    mine(model)


@pytest.mark.parametrize("answer, failing, words", [
    (lab_average, ["2 ranks", "3 ranks"],
     "the lab's own implementation did the work (lk's ddp.naive.average_gradients ran"),
    (through_the_store, ["2 ranks", "3 ranks"], "side channel: the gradients are right"),
    (reads_the_oracle, ["2 ranks", "3 ranks"], "differs from the oracle"),
    (averages_a_copy, ["2 ranks", "3 ranks"], "still this rank's local gradient"),
    (first_parameter_only, ["2 ranks", "3 ranks"], "still this rank's local gradient"),
    (divides_by_two, ["3 ranks"], "differs from the oracle"),
])
def test_lazy_gradient_averaging_fails_a_named_case(answer, failing, words):
    cases = {c.name: c for c in check_average_gradients(answer, world_sizes=(2, 3))}
    assert sorted(n for n, c in cases.items() if not c.passed) == failing
    assert words in cases[failing[0]].detail, cases[failing[0]].detail


def test_the_solution_of_exercise_1_passes_everywhere():
    cases = check_average_gradients(solution)
    assert [c.passed for c in cases] == [True, True, True], cases


# ---------------------------------------------------------------- OverlapDDP
class OverlapDDP(nn.Module):             # the notebook's solution
    def __init__(self, module, broadcast="all", src=0):
        super().__init__()
        self.module, self.handles = module, []
        tensors = {"all": list(module.parameters()) + list(module.buffers()),
                   "parameters": list(module.parameters()), "none": []}[broadcast]
        for t in tensors:
            dist.broadcast(t.data, src=src)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param):
        param.grad /= dist.get_world_size()
        self.handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for handle in self.handles:
            handle.wait()
        self.handles.clear()


class Reseeds(OverlapDDP):
    """Identical replicas without a broadcast: every rank re-initialises from seed 0."""

    def __init__(self, module):
        torch.manual_seed(0)
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        super().__init__(module, broadcast="none")


class HandAveraged(ReplicatedModule):
    """Step 1 by the lab's ReplicatedModule, the averaging after backward by hand: no overlap."""

    def finish_gradient_synchronization(self):
        solution(self.module)


class TokenOverlap(HandAveraged):
    """A 1-element async all-reduce during backward to look overlapped; the real work after."""

    def __init__(self, module):
        super().__init__(module)
        self.token = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.token.append(dist.all_reduce(torch.zeros(1), async_op=True)))

    def finish_gradient_synchronization(self):
        for w in self.token:
            w.wait()
        self.token.clear()
        super().finish_gradient_synchronization()


class NeverWaits(OverlapDDP):
    """Returns without waiting on its handles. To keep this test's numbers right it spins
    until the raw works are done, which the checker does not see: a race a learner's
    version (sleep, or nothing) loses only on a slow day."""

    def finish_gradient_synchronization(self):
        while not all(h._work.is_completed() for h in self.handles):
            time.sleep(0.001)
        self.handles.clear()


class DecoyOverlap(HandAveraged):
    """Zeros of every gradient's size, kept in a closure, all-reduced during backward to look
    overlapped; the real (synchronous) averaging after backward."""

    def __init__(self, module):
        super().__init__(module)
        self.decoys = []
        for p in module.parameters():
            if p.requires_grad:
                zeros = torch.zeros(p.numel())
                p.register_post_accumulate_grad_hook(
                    lambda p, z=zeros: self.decoys.append(dist.all_reduce(z, async_op=True)))

    def finish_gradient_synchronization(self):
        for w in self.decoys:
            w.wait()
        self.decoys.clear()
        super().finish_gradient_synchronization()


class TorchDDPBehindDecoys(DecoyOverlap):
    """torch's DDP does the work, hidden in a closure; decoys overlap."""

    def __init__(self, module):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(module)
        super().__init__(module)
        self.forward = lambda *a, **kw: ddp(*a, **kw)

    def finish_gradient_synchronization(self):
        for w in self.decoys:
            w.wait()
        self.decoys.clear()


class StoreBehindDecoys(DecoyOverlap):
    """Decoys overlap; the gradients are averaged through the TCPStore."""

    def finish_gradient_synchronization(self):
        for w in self.decoys:
            w.wait()
        self.decoys.clear()
        _store_average([p.grad for p in self.module.parameters() if p.grad is not None])


class ReadsTheOracle(OverlapDDP):
    """Overlaps honestly, then replaces the averages with the checker's own oracle module's."""

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        reads_the_oracle(self.module)


class Summed(OverlapDDP):
    def _hook(self, param):
        self.handles.append(dist.all_reduce(param.grad, async_op=True))


class TorchDDPInside(nn.Module):
    """Call the library instead of writing it."""

    def __init__(self, module):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.module = DDP(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass


@pytest.mark.parametrize("cls, words", [
    (lambda m: OverlapDDP(m, broadcast="none"), "rank 1's parameter `embed.weight` is still its own"),
    (lambda m: OverlapDDP(m, broadcast="parameters"), "rank 1's buffer `shift` is still its own"),
    (lambda m: OverlapDDP(m, src=1), "rank 0's parameter `embed.weight` is not the one rank 0"),
    (Reseeds, "rank 0's parameter `embed.weight` is not the one rank 0"),
    (HandAveraged, "no all_reduce was launched with async_op=True during backward"),
    (NaiveDDP, "(lk's ddp.naive.NaiveDDP.finish_gradient_synchronization, lk's "
               "ddp.naive.average_gradients ran"),
    (lambda m: BucketedDDP(m, bucket_cap_mb=0), "(lk's ddp.bucketed.BucketedDDP._launch, lk's "
                                                "ddp.bucketed.BucketedDDP.finish_gradient"),
    (TokenOverlap, "only 3 of the 108 gradient elements were all-reduced asynchronously"),
    (NeverWaits, "without waiting for 3 all-reduce handle(s)"),
    (Summed, "you summed the gradients"),
    (TorchDDPInside, "no all_reduce was launched with async_op=True during backward"),
    (DecoyOverlap, "did not carry this rank's gradients"),
    (TorchDDPBehindDecoys, "did not carry this rank's gradients"),
    (StoreBehindDecoys, "did not carry this rank's gradients"),
    (ReadsTheOracle, "differs from the oracle"),
])
def test_a_wrapper_that_skips_a_step_fails(cls, words):
    case = check_ddp_wrapper(cls, world_sizes=(2,))[0]
    assert not case.passed and words in case.detail, case.detail


def test_the_solution_of_exercise_2_passes_everywhere():
    cases = check_ddp_wrapper(OverlapDDP)
    assert [c.passed for c in cases] == [True, True, True], cases
