"""The exercise checkers and quiz keys of notebook 04 (pitfalls).

Checkers grade by running: :func:`check_replica_training` runs the learner's repaired training
loop on real ranks and compares every replica with one process training on the whole batch —
each rank's shard (``P.shard_batch``) is data only that rank has, drawn from a secret of its
own, and the rows of the "global batch" that belong to other ranks are NaN, so a loop that
skips the all-reduce, trains every rank on the whole batch or returns the oracle's own
fingerprint fails; and each rank counts the bytes its gloo sockets sent while the loop ran
(:func:`labkit.grading.watch.tcp_bytes_sent`, the TCPStore's left out), so a loop that
averaged through a side channel (the store, a file) instead of a collective fails too;
:func:`check_staleness_lr` drives the delay-k simulation with the learner's
learning-rate rule at every delay from 0 to 16.
The quiz keys read the answer out of the learner's own mystery hang.
"""
from __future__ import annotations

import os

from ...grading.watch import store_port, tcp_bytes_sent
from ...diagnosis import compare_fingerprints, diagnose, fingerprint
from ...grading.exercise import case
from ...runtime import run
from .. import divergence
from ..staleness import delayed_sgd

__all__ = ["check_replica_training", "check_staleness_lr", "mystery_stuck_rank",
           "mystery_collective"]


# ------------------------------------------------------------------ exercise checkers
def _private_data(rank: int, world_size: int, fn, steps: int) -> dict:
    """Runs in every rank: the learner's loop, with this rank's shards known to it alone."""
    import torch
    secret = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
    shards: dict[int, tuple] = {}
    original = divergence.global_batch

    def global_batch(step: int, n: int = divergence.GLOBAL_BATCH):
        per = n // world_size
        if step not in shards:
            x = torch.randn(per, 6, generator=secret)
            shards[step] = (x, x.sum(dim=1, keepdim=True).sin())
        x, y = torch.full((n, 6), float("nan")), torch.full((n, 1), float("nan"))
        x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per] = shards[step]
        return x, y                    # the other ranks' rows are theirs: NaN here

    divergence.global_batch = global_batch   # what shard_batch (and global_batch) read
    port = store_port()
    before = tcp_bytes_sent(port)
    try:
        fp = fn(rank, world_size, steps=steps)
    finally:
        divergence.global_batch = original
    after = tcp_bytes_sent(port)
    return {"fingerprint": fp, "shards": shards,
            "sent": None if None in (before, after) else after - before}


def _oracle(values: list[dict], steps: int, lr: float = 0.1):
    """One process on the whole batch: every rank's shard of each step, in rank order."""
    import torch
    from torch import nn
    model = divergence.tiny_model()
    for step in range(steps):
        x = torch.cat([v["shards"][step][0] for v in values])
        y = torch.cat([v["shards"][step][1] for v in values])
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        divergence.sgd_step(model, lr)
    return fingerprint(model)


def _side_channel(values: list[dict], steps: int) -> str | None:
    """A rank whose gloo sockets sent less than its gradients of every step hold."""
    need = 4 * steps * sum(p.numel() for p in divergence.tiny_model().parameters())
    for r, v in enumerate(values):
        if v["sent"] is None:
            return f"cannot verify rank {r}: it has no TCP socket whose byte counter can be read"
        if v["sent"] < need:
            return (f"side channel: the replicas are right, but rank {r}'s gloo sockets sent "
                    f"{v['sent']} bytes in {steps} steps, less than its {need} bytes of "
                    f"gradients; every rank's gradients must leave it. They went some way that "
                    f"is not a collective (the process group's TCPStore, a file): use "
                    f"dist.all_reduce")
    return None


def check_replica_training(fn) -> list:
    """Checker of exercise 04.fix_training: replicas identical AND equal to one-process training."""
    def on(world_size, steps):
        def test():
            # gloo: the gradients must cross its TCP sockets, where the kernel counts them
            res = run(_private_data, world_size, args=(fn, steps), backend="gloo", timeout=5,
                      deadline=20, echo=False)
            for r, v in enumerate(res.values):
                missing = [s for s in range(steps) if s not in v["shards"]]
                assert not missing, (f"rank {r} never asked for its shard of step {missing[0]}: "
                                     f"train every rank on P.shard_batch(rank, world_size, step)")
            fps = [v["fingerprint"] for v in res.values]
            assert all(hasattr(fp, "sums") for fp in fps), (
                f"return lk.diagnosis.fingerprint(model) from every rank, not "
                f"{type(next(fp for fp in fps if not hasattr(fp, 'sums'))).__name__}")
            if any(x != x for fp in fps for sums in fp.sums for x in sums):
                raise AssertionError("a replica's parameters are NaN: it trained on rows of the "
                                     "global batch that belong to other ranks. Each rank trains "
                                     "on its own P.shard_batch(...) only; the all-reduce brings "
                                     "in the rest")
            v = diagnose(fps)
            assert v.kind == "ok", f"replicas disagree after {steps} steps: {v.headline}"
            o = compare_fingerprints([_oracle(res.values, steps), fps[0]], 1e-5)
            assert o.ok, ("replicas agree with each other but not with one process training on the "
                          "whole batch: average the gradients (sum / world_size), don't just sum")
            problem = _side_channel(res.values, steps)
            assert problem is None, problem
            return "identical replicas, equal to the one-process oracle"
        return test
    return [case(f"{n} ranks, {s} steps", on(n, s)) for n, s in ((2, 3), (3, 2))]


def check_staleness_lr(fn) -> list:
    """Checker of exercise 04.staleness_lr: ``fn(lr, staleness)`` must tame every delay 0 to 16.

    One case that ``fn`` is ``lr`` itself at staleness 0, for any ``lr``, and one case per
    delay from 0 to 16, as the exercise says (a table tuned to a few delays fails the others).
    """
    start = delayed_sgd(0, 1.0, 1)[0]

    def at_zero():
        for lr in (1.0, 0.5, 0.1):
            got = float(fn(lr, 0))
            assert got == lr, f"with staleness 0 keep the base rate: fn({lr}, 0) returned {got!r}"
        return "fn(lr, 0) == lr"

    def converges(k):
        def test():
            final = delayed_sgd(k, 1.0, 300, fn)[-1]
            assert final < 0.01, (f"with delay {k} the loss ends at {final:.3g} (it starts near "
                                  f"{start:.2g}): the step is still too large, or so small that "
                                  f"nothing is learned")
            return f"final loss {final:.4g}"
        return test
    return [case("lr itself at staleness 0", at_zero)] + \
        [case(f"delay {k}", converges(k)) for k in range(17)]


# ------------------------------------------------------------------ quiz keys
def mystery_stuck_rank(mystery) -> int:
    """Quiz key: the rank that held the others up in the learner's own mystery run."""
    v = diagnose(mystery)
    if v.kind != "missing_rank" or len(v.culprits) != 1:
        raise ValueError(f"this run did not hang on one rank ({v.kind}); run the mystery cell "
                         f"again")
    return v.culprits[0]


def mystery_collective(mystery) -> str:
    """Quiz key: the collective the other ranks were waiting in."""
    v = diagnose(mystery)
    if not v.collective:
        raise ValueError("no rank was inside a collective in this run; run the mystery cell again")
    return v.collective

