"""Notebook 04's exercises (04.fix_training, 04.staleness_lr) cannot be passed without doing them.

Before: every rank could read the whole batch (``P.global_batch``) or the oracle itself
(``P.oracle_fingerprint``) and pass 04.fix_training with no communication at all; a learning
rate tuned to the four delays the checker tried (0, 2, 4, 16) passed 04.staleness_lr, and so
did one that ignores ``lr`` (the checker tried ``fn(1.0, 0)`` only). The classes of shortcut,
and the answers that feed them:

04.fix_training
* hidden state: n.a.: each rank's shards come from a secret it draws per grading, so state
  kept anywhere in a rank holds nothing of another rank's shards;
* the library doing the work: n.a.: the exercise asks for a repaired loop, not an all-reduce
  written by hand; torch's DDP is a right repair (and averages over gloo's sockets);
* a copied oracle: ``returns_the_oracle`` (the lab's own ``P.oracle_fingerprint``);
* a side channel: ``through_the_store`` (gradients averaged through the process group's
  TCPStore); a collective issued from another thread is the collective itself;
* a computation not split as required: ``whole_batch_everywhere``.

04.staleness_lr is a pure formula, run in the grader's own process on a simulation:
* hidden state: n.a.: the rule is called with the staleness itself and judged only by the loss
  the simulation reaches; state kept between calls knows nothing the arguments do not;
* the library doing the work: n.a.: no library computes a learning-rate rule;
* a copied oracle: ``tuned to 0, 2, 4, 16`` below (a table of the delays once checked);
* a side channel: n.a.: no ranks, no messages;
* a computation not split as required: n.a.: nothing is distributed.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from labkit.pitfalls import divergence as P
from labkit.pitfalls.check import check_replica_training, check_staleness_lr

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks cannot import this file

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- 04.fix_training
def solution(rank, world_size, steps=3):       # the notebook's solution
    import torch.distributed as dist
    from torch import nn

    from labkit.diagnosis import fingerprint
    model = P.tiny_model().to(P.device())
    for step in range(steps):
        x, y = P.shard_batch(rank, world_size, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        P.sgd_step(model, 0.1)
    return fingerprint(model)


def whole_batch_everywhere(rank, world_size, steps=3):
    """No sharding, no communication: every rank trains on the global batch."""
    from torch import nn

    from labkit.diagnosis import fingerprint
    model = P.tiny_model()
    for step in range(steps):
        x, y = P.global_batch(step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        P.sgd_step(model, 0.1)
    return fingerprint(model)


def returns_the_oracle(rank, world_size, steps=3):
    return P.oracle_fingerprint(steps)


def divides_by_two(rank, world_size, steps=3):
    import torch.distributed as dist
    from torch import nn

    from labkit.diagnosis import fingerprint
    model = P.tiny_model()
    for step in range(steps):
        x, y = P.shard_batch(rank, world_size, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2                        # right on 2 ranks only
        P.sgd_step(model, 0.1)
    return fingerprint(model)


def returns_nothing(rank, world_size, steps=3):
    return None


def through_the_store(rank, world_size, steps=3):
    """The repaired loop, but the gradients are averaged through the process group's TCPStore."""
    import io

    import torch
    import torch.distributed as dist
    from torch import nn

    from labkit.diagnosis import fingerprint
    store = dist.distributed_c10d._get_default_store()
    model = P.tiny_model()
    for step in range(steps):
        x, y = P.shard_batch(rank, world_size, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        buf = io.BytesIO()
        torch.save([p.grad for p in model.parameters()], buf)
        store.set(f"side/{step}/{rank}", buf.getvalue())
        every = [torch.load(io.BytesIO(store.get(f"side/{step}/{r}"))) for r in range(world_size)]
        for i, p in enumerate(model.parameters()):
            p.grad = sum(e[i] for e in every) / world_size
        P.sgd_step(model, 0.1)
    return fingerprint(model)


@pytest.mark.parametrize("answer, failing, words", [
    (whole_batch_everywhere, ["2 ranks, 3 steps", "3 ranks, 2 steps"], "parameters are NaN"),
    (returns_the_oracle, ["2 ranks, 3 steps", "3 ranks, 2 steps"], "parameters are NaN"),
    (P.broken_training, ["2 ranks, 3 steps", "3 ranks, 2 steps"], "replicas disagree"),
    (divides_by_two, ["3 ranks, 2 steps"], "not with one process training on the whole batch"),
    (returns_nothing, ["2 ranks, 3 steps", "3 ranks, 2 steps"], "never asked for its shard"),
    (through_the_store, ["2 ranks, 3 steps", "3 ranks, 2 steps"],
     "side channel: the replicas are right"),
])
def test_a_lazy_training_loop_fails_a_named_case(answer, failing, words):
    cases = {c.name: c for c in check_replica_training(answer)}
    assert sorted(n for n, c in cases.items() if not c.passed) == failing
    assert words in cases[failing[0]].detail, cases[failing[0]].detail


def test_the_repaired_loop_still_passes():
    assert all(c.passed for c in check_replica_training(solution))


# ---------------------------------------------------------------- 04.staleness_lr
@pytest.mark.parametrize("rule, failing", [
    (lambda lr, s: lr, [f"delay {k}" for k in range(1, 17)]),
    (lambda lr, s: {0: lr, 2: lr / 3, 4: lr / 5, 16: lr / 17}.get(s, lr),      # tuned to 0, 2, 4, 16
     ["delay 1", "delay 3"] + [f"delay {k}" for k in range(5, 16)]),
    (lambda lr, s: 1.0 / (s + 1), ["lr itself at staleness 0"]),               # ignores lr
    (lambda lr, s: lr / max(1, s), ["delay 1"]),
    (lambda lr, s: lr / (s + 1) ** 0.5, [f"delay {k}" for k in range(3, 17)]),  # too gentle
])
def test_a_rule_that_misses_a_delay_fails_that_delay(rule, failing):
    cases = check_staleness_lr(rule)
    assert [c.name for c in cases if not c.passed] == failing


def test_the_solution_rule_still_passes_every_delay():
    cases = check_staleness_lr(lambda lr, s: lr / (s + 1))
    assert len(cases) == 18 and all(c.passed for c in cases)
