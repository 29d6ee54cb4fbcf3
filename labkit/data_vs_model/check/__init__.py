"""Checker for notebook 01's exercise: one training step of a model split across 2 ranks.

The learner writes ``two_stage_step(rank, stage, x, target)``: rank 0 runs its
``stage`` on ``x`` and sends the activation to rank 1; rank 1 receives it,
runs its stage, computes ``F.mse_loss(out, target)``, calls backward and sends
the activation's gradient back; rank 0 receives it and finishes backward.
Rank 1 returns the loss, rank 0 returns ``None``.

Each case runs on 2 real ranks and compares **both** stages' gradients (and
the loss) with the same model run whole in one process, at every step. Nothing
can be computed without the messages: each rank draws its own stage's weights
and its own data (rank 0 the input ``x``, rank 1 the ``target``) from a secret
only it holds; rank 1's ``x`` and rank 0's ``target`` are filled with NaN. The
oracle is rebuilt afterwards, in the checker's process, from what the ranks
report. The messages must cross gloo's sockets: each rank counts the bytes its sockets sent
during every step (:func:`labkit.grading.watch.tcp_bytes_sent`, the TCPStore's sockets
left out),
and a rank that sent less than the tensor it owes its peer (rank 0 the activation, rank 1
its gradient) passed it through a side channel (the store, a file) and fails. A loss that
matches the previous step's activation names the hidden state it came from. Short timeouts
turn a missing ``send``/``recv`` (a deadlock) into a failed case within seconds.

Example::

    lk.exercise.check("01.two_stage_step", two_stage_step)

Notebook 01's quiz questions all have fixed keys in ``quizzes/01_data_vs_model_parallelism.toml``:
the pipeline questions are predictions the notebook then measures.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ...grading.watch import store_port, tcp_bytes_sent
from ...common.models import mlp
from ...common.ranks import device
from ...grading.exercise import Case, case
from ...runtime import run

__all__ = ["check_two_stage_step", "CASES"]

CASES = (  # (name, width, batch, steps)
    ("width 8, batch 4, 1 step", 8, 4, 1),
    ("width 16, batch 1, 1 step", 16, 1, 1),
    ("width 8, batch 6, 3 steps in a row", 8, 6, 3),
)
TIMEOUT_S = 3.0


def _rank(rank: int, world_size: int, fn, width: int, batch: int, steps: int) -> dict:
    """Runs in both ranks: this rank's stage and data come from a secret of its own."""
    dev = device()
    secret = int.from_bytes(os.urandom(7), "little")
    whole = mlp(width, 4, seed=secret)
    stage = (whole[:2] if rank == 0 else whole[2:]).to(dev)
    start = {n: p.detach().cpu().clone() for n, p in stage.named_parameters()}
    g = torch.Generator().manual_seed(secret)
    nan = torch.full((batch, width), float("nan"))
    port = store_port()
    out = []
    for _ in range(steps):
        mine = torch.randn(batch, width, generator=g)       # rank 0: x; rank 1: the target
        x, target = (mine, nan) if rank == 0 else (nan, mine)
        stage.zero_grad()
        before = tcp_bytes_sent(port)
        loss = fn(rank, stage, x.to(dev), target.to(dev))
        after = tcp_bytes_sent(port)
        out.append({"data": mine, "sent": None if None in (before, after) else after - before,
                    "loss": None if loss is None else float(torch.as_tensor(loss).detach()),
                    "grads": {n: None if p.grad is None else p.grad.detach().cpu().clone()
                              for n, p in stage.named_parameters()}})
    return {"start": start, "steps": out}


def _oracle(width: int, values: list[dict]) -> list[dict]:
    """The whole model in one process, from both ranks' stages and data."""
    whole = mlp(width, 4)
    with torch.no_grad():
        for name, p in whole.named_parameters():   # slices keep their names ("2.0.weight")
            p.copy_({**values[0]["start"], **values[1]["start"]}[name])
    out, before = [], None
    for s0, s1 in zip(values[0]["steps"], values[1]["steps"]):
        whole.zero_grad()
        loss = F.mse_loss(whole(s0["data"]), s1["data"])
        loss.backward()
        with torch.no_grad():        # the loss from the previous step's activation, if any
            stale = None if before is None else F.mse_loss(whole(before), s1["data"]).item()
        before = s0["data"]
        out.append({"loss": loss.item(), "stale": stale,
                    "grads": {n: p.grad.clone() for n, p in whole.named_parameters()}})
    return out


def _side_channel(step: int, rank: int, got: dict, batch: int, width: int) -> str | None:
    """A rank whose gloo sockets sent less than the tensor it owes its peer, or unwatched."""
    sent, need = got["sent"], batch * width * 4
    if sent is None:
        return (f"cannot verify step {step} on rank {rank}: it has no TCP socket whose byte "
                f"counter can be read")
    if sent < need:
        what = "activation" if rank == 0 else "gradient of the activation"
        return (f"side channel: at step {step} rank {rank}'s gloo sockets sent {sent} "
                f"bytes, less than the {need}-byte {what} it must send; the data went some way "
                f"that is not a message (the process group's TCPStore, a file). Use dist.send "
                f"and dist.recv")
    return None


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-5 * max(1.0, want)


def _test(fn, width: int, batch: int, steps: int):
    def test():
        # gloo: the messages must cross its TCP sockets, where the kernel counts them
        res = run(_rank, 2, args=(fn, width, batch, steps), backend="gloo", timeout=TIMEOUT_S,
                  deadline=TIMEOUT_S + 4, echo=False)
        for step, want in enumerate(_oracle(width, res.values)):
            for rank in (1, 0):                 # rank 1's loss first: it explains the rest
                got = res.values[rank]["steps"][step]
                if rank == 1:
                    assert got["loss"] is not None, \
                        f"step {step}: rank 1 returned None; it must return the loss"
                    assert _close(got["loss"], want["loss"]), \
                        (f"step {step}: rank 1's loss is {got['loss']:.6g}, the whole model's is "
                         f"{want['loss']:.6g} " + (
                             "(it is the loss of the previous step's activation: hidden state, "
                             "a message kept from an earlier call instead of received now)"
                             if want["stale"] is not None and _close(got["loss"], want["stale"])
                             else "(NaN means rank 1 used its own x instead of the activation "
                                  "it received)"))
                for name, g in got["grads"].items():
                    fix = "call h.backward(grad)" if rank == 0 else "call loss.backward()"
                    assert g is not None, \
                        f"step {step}, rank {rank}: `{name}` has no gradient: {fix}"
                    w = want["grads"][name]
                    assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), (
                        f"step {step}, rank {rank}: gradient of `{name}` differs from the whole "
                        f"model's by up to {(g - w).abs().max().item():.3g}" +
                        (" (did rank 1 send the gradient of its *input* activation?)"
                         if rank == 0 else ""))
            for rank in (0, 1):
                problem = _side_channel(step, rank, res.values[rank]["steps"][step], batch,
                                        width)
                assert problem is None, problem
        return f"both ranks match the whole model at {steps} step{'s' * (steps > 1)}"
    return test


def check_two_stage_step(fn) -> list[Case]:
    """Grade ``fn(rank, stage, x, target)`` on 2 ranks against the unsplit model.

    Returns one :class:`~labkit.grading.exercise.Case` per scenario in :data:`CASES`.
    """
    cases: list[Case] = []
    for name, width, batch, steps in CASES:
        c = case(name, _test(fn, width, batch, steps))
        cases.append(c)
        if not c.passed and "Timed out" in c.detail:     # one deadlock is enough to know
            c.detail = (f"deadlock: a rank waited more than {TIMEOUT_S:.0f} s. Every send needs "
                        f"a matching recv on the other rank (same size), in the same order. "
                        f"{c.detail}")
            cases += [Case(n, False, "not run: fix the deadlock first")
                      for n, *_ in CASES[len(cases):]]
            break
    return cases

