"""The "build DDP by hand" exercise checkers: every rank, every step, against a one-process oracle.

Graded in the style of Stanford CS336 assignment 2, but stricter:

* the model (:class:`~labkit.ddp.check.oracle.TiedTiny`) has the traps: a **frozen** parameter,
  **tied** weights, a **buffer**, and a **mean** loss, so summing instead of averaging fails;
* **every rank is compared at every step** (gradients after your sync, parameters and buffers
  after the optimizer step), not just rank 0 at the end; **2, 3 and 4 ranks**; the last batch
  is **uneven**;
* **nothing to copy**: every rank draws its data (and, for the wrapper, its initial weights and
  buffers) from a secret only it holds; the oracle is replayed afterwards, in the checker's
  process, from what the ranks report. A rank cannot know the average without receiving the
  other ranks' gradients, and a wrapper that skips step 1 (broadcast rank 0's parameters *and*
  buffers) starts from the wrong weights;
* the wrapper must **overlap**: every gradient is all-reduced asynchronously during backward
  (not a token all-reduce, and not a decoy: what those all-reduces carry must be this rank's
  gradients, by their sum of squares), and every handle is waited for before the optimizer
  step;
* **not the lab's own**: ``lk.ddp.average_gradients``, ``NaiveDDP`` and ``BucketedDDP`` are
  counted when they run (:mod:`labkit.grading.references`); an answer that calls them fails;
* **no side channel**: each rank counts the bytes its gloo sockets sent during each step
  (:func:`labkit.grading.watch.tcp_bytes_sent`, the TCPStore's sockets left out); a rank
  that sent less than its gradients hold got the average some other way (the store, a file);
* **short timeouts**: an answer that deadlocks fails in seconds, naming the rank and the line.

Example::

    lk.exercise.check("02.average_gradients", average_gradients)   # per-case report
    cases = lk.ddp.check.check_average_gradients(average_gradients)  # list of exercise.Case
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F

from ...grading.watch import store_port, tcp_bytes_sent
from ...common.ranks import device
from ...grading.exercise import Case
from ...grading.references import reference_problem, references_used
from ...runtime import run
from ..naive import broadcast_parameters
from .oracle import (LR, STEPS, TiedTiny, oracle_history, rank_batches, sgd_step,
                     shard_batches, state_of)

__all__ = ["TiedTiny", "shard_batches", "oracle_history", "check_average_gradients",
           "check_ddp_wrapper", "WORLD_SIZES"]

WORLD_SIZES = (2, 3, 4)
_LAB = "labkit.ddp."     # the lab's own DDP (average_gradients, NaiveDDP, BucketedDDP)
TIMEOUT_S = 3.0          # a collective waiting longer than this is a deadlock here
ATOL, RTOL = 1e-5, 1e-4


class _Spy:
    """Stands in for ``dist.all_reduce`` in a rank: who called it, when, on how much, waited?"""

    def __init__(self, original) -> None:
        self.original, self.calls = original, []

    def __call__(self, tensor, *args, **kwargs):
        # positional order: all_reduce(tensor, op, group, async_op)
        is_async = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        call = {"during": torch._C._current_graph_task_id() != -1, "async": is_async,
                "numel": tensor.numel(), "waited": not is_async,
                "sumsq": float(tensor.detach().double().square().sum())}
        self.calls.append(call)
        work = self.original(tensor, *args, **kwargs)
        return _Handle(work, call) if is_async and work is not None else work


class _Handle:
    """The async all-reduce's handle, noting whether anyone waited for it."""

    def __init__(self, work, call: dict) -> None:
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        self._call["waited"] = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._call["waited"] = True
        return self._work.get_future()

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        self._call["waited"] = self._call["waited"] or done
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _rank_case(rank: int, world_size: int, answer, mode: str, steps: int, lr: float) -> dict:
    """Runs in every rank: train with the learner's answer from private data, record each step."""
    import torch.distributed as dist
    secret = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
    torch.manual_seed(int(torch.randint(2**62, (1,), generator=secret)))
    model = TiedTiny().to(device())              # weights and buffer differ on every rank
    before = state_of(model)
    if mode == "function":
        broadcast_parameters(model)              # the harness does step 1 for this exercise
    spy = _Spy(dist.all_reduce)
    dist.all_reduce = spy
    try:
        with references_used(_LAB) as used:
            wrapped = answer(model) if mode == "wrapper" else model
        lab = list(used)
        start = state_of(model)
        batches = rank_batches(rank, world_size, secret, steps)
        steps_out, port = [], store_port()
        for x, y in batches:
            first, sent = len(spy.calls), tcp_bytes_sent(port)
            model.zero_grad()
            with references_used(_LAB) as used:
                F.cross_entropy(wrapped(x.to(device())), y.to(device())).backward()
                if mode == "wrapper":
                    wrapped.finish_gradient_synchronization()
                else:
                    answer(model)
            lab += used
            grads = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                     for n, p in model.named_parameters()}
            after = tcp_bytes_sent(port)
            sgd_step(model, lr)
            steps_out.append({"grads": grads, "params": state_of(model),
                              "sent": None if None in (sent, after) else after - sent,
                              "calls": [dict(c) for c in spy.calls[first:]]})
    finally:
        dist.all_reduce = spy.original
    return {"before": before, "start": start, "batches": batches, "steps": steps_out,
            "references": sorted(set(lab))}


def _diagnose(name: str, got: torch.Tensor | None, want: torch.Tensor | None,
              local: torch.Tensor | None, world_size: int) -> str | None:
    """None when equal; otherwise a sentence that says what is wrong and how to fix it."""
    if want is None:
        return None if got is None else (f"`{name}` is frozen (requires_grad=False) but got a "
                                         f"gradient: leave parameters whose .grad is None alone.")
    if got is None:
        return f"`{name}` has no gradient after your sync; the oracle has one."
    if torch.allclose(got, want, atol=ATOL, rtol=RTOL):
        return None
    diff = (got - want).abs().max().item()
    if torch.allclose(got, want * world_size, atol=ATOL * world_size, rtol=RTOL):
        return (f"`{name}` is {world_size}x the oracle (max |diff| {diff:.3g}): you summed the "
                f"gradients; divide by world_size to average them (the loss is a mean).")
    if local is not None and torch.allclose(got * world_size, local, atol=ATOL, rtol=RTOL):
        return (f"`{name}` is this rank's own gradient divided by {world_size}: it never received "
                f"the other ranks' gradients. Use all_reduce, so every rank gets the sum "
                f"(dist.reduce delivers it to one rank only).")
    if local is not None and torch.allclose(got, local, atol=ATOL, rtol=RTOL):
        return (f"`{name}` is still this rank's local gradient: nothing was averaged here. Every "
                f"rank must call all_reduce on every gradient (a reduce to rank 0 is not enough).")
    return f"`{name}` differs from the oracle by up to {diff:.3g}."


def _rank_problem(world_size: int, got: dict, want: dict, local: dict) -> str | None:
    for name, w in want["grads"].items():
        msg = _diagnose(name, got["grads"].get(name), w, local.get(name), world_size)
        if msg:
            return msg
    for name, w in want["params"].items():
        if not torch.allclose(got["params"][name], w, atol=ATOL, rtol=RTOL):
            return f"`{name}` after the optimizer step differs from the oracle."
    return None


def _start_problem(values: list[dict], mode: str) -> str | None:
    """Step 1: every rank must start from rank 0's own parameters and buffers."""
    want, buffers = values[0]["before"], dict(TiedTiny().named_buffers())
    who = "your wrapper" if mode == "wrapper" else "replication"
    for r, v in enumerate(values):
        for name, w in want.items():
            if torch.equal(v["start"][name], w):
                continue
            kind = "buffer" if name in buffers else "parameter"
            if r == 0:
                return (f"after {who}, rank 0's {kind} `{name}` is not the one rank 0 started "
                        f"with: replicate rank 0's weights (src=0) instead of replacing them.")
            return (f"after {who}, rank {r}'s {kind} `{name}` is still its own, not rank 0's: "
                    f"step 1 broadcasts rank 0's parameters and buffers to every rank "
                    f"(dist.broadcast(t.data, src=0) for each) before training.")
    return None


def _compare(world_size: int, values: list[dict], oracle: list[dict]) -> str | None:
    """The first disagreement with the oracle, checking every rank at every step."""
    for step, want in enumerate(oracle):
        problems = [_rank_problem(world_size, values[r]["steps"][step], want, want["local"][r])
                    for r in range(world_size)]
        bad = [r for r, p in enumerate(problems) if p]
        if bad:
            hint = ""
            if problems[0] is None:
                hint = (f" Rank 0 matches but rank{'s' * (len(bad) > 1)} "
                        f"{', '.join(map(str, bad))} do{'es' * (len(bad) == 1)} not: only rank 0 "
                        f"got the averaged gradients (a grader that checks rank 0 alone would "
                        f"have passed this).")
            return f"step {step}, rank {bad[0]}: {problems[bad[0]]}{hint}"
    return None


def _side_channel_problem(values: list[dict]) -> str | None:
    """A rank whose gloo sockets sent less than its gradients hold got the average elsewhere."""
    need = 4 * sum(p.numel() for p in TiedTiny().parameters() if p.requires_grad)
    for r, v in enumerate(values):
        for step, s in enumerate(v["steps"]):
            if s["sent"] is None:
                return (f"cannot verify step {step} on rank {r}: it has no TCP socket whose "
                        f"byte counter can be read")
            if s["sent"] < need:
                return (f"side channel: the gradients are right, but at step {step} rank {r}'s "
                        f"gloo sockets sent {s['sent']} bytes, less than its {need} bytes of "
                        f"gradients; every rank's gradients must leave it. They went some way "
                        f"that is not a collective (the process group's TCPStore, a file): "
                        f"use dist.all_reduce")
    return None


def _carried(calls: list[dict], local: dict, world_size: int) -> bool:
    """Did the all-reduces launched during backward carry this rank's gradients (sum of
    squares equal to the local gradients', or to theirs divided by world_size first)?"""
    got = sum(c["sumsq"] for c in calls if c["during"] and c["async"])
    want = sum(float(g.double().square().sum()) for g in local.values() if g is not None)
    return any(abs(got - w) <= 1e-3 * w + 1e-12 for w in (want, want / world_size ** 2))


def _overlap_problem(values: list[dict], oracle: list[dict]) -> str | None:
    """The wrapper's all-reduces: every gradient in flight during backward, every handle waited."""
    need = sum(p.numel() for p in TiedTiny().parameters() if p.requires_grad)
    for r, v in enumerate(values):
        for step, s in enumerate(v["steps"]):
            overlapped = sum(c["numel"] for c in s["calls"] if c["during"] and c["async"])
            if overlapped == 0:
                return ("numbers are right, but no all_reduce was launched with async_op=True "
                        "during backward: there is no overlap. Launch it from a gradient hook "
                        "(register_post_accumulate_grad_hook).")
            if overlapped < need:
                return (f"step {step}, rank {r}: only {overlapped} of the {need} gradient "
                        f"elements were all-reduced asynchronously during backward; every "
                        f"gradient's all-reduce must start from its hook.")
            if not _carried(s["calls"], oracle[step]["local"][r], len(values)):
                return (f"step {step}, rank {r}: the all-reduces launched during backward did "
                        f"not carry this rank's gradients (their sum of squares differs): a "
                        f"decoy, a tensor kept aside (hidden state) while the real averaging "
                        f"happened elsewhere. All-reduce each parameter's .grad from its hook.")
            unwaited = sum(not c["waited"] for c in s["calls"])
            if unwaited:
                return (f"step {step}, rank {r}: finish_gradient_synchronization() returned "
                        f"without waiting for {unwaited} all-reduce handle(s); the optimizer "
                        f"step may read half-reduced gradients. Call .wait() on every handle.")
    return None


def _learner_line(traceback: str) -> str:
    """' (in average_gradients, line 7: dist.all_reduce(p.grad))': your deepest frame."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n((?:    .*\n)?)', traceback + "\n")
    mine = [f for f in frames if "site-packages" not in f[0] and "/labkit/" not in f[0]]
    if not mine:
        return ""
    _, line, func, src = mine[-1]
    where = f"in {func}, line {line}"
    return f" ({where}: {src.strip()})" if src.strip() else f" ({where})"


def _failure(name: str, bad) -> Case:
    error = bad.error or ""
    where = _learner_line(bad.traceback or "") or (f" (stuck in {bad.where})" if bad.where else "")
    if bad.status == "hung" or "Timed out" in error:
        return Case(name, False, f"rank {bad.rank} waited more than {TIMEOUT_S:.0f} s in a "
                    f"collective{where}: a deadlock. Every rank must call the same collectives, "
                    f"on the same tensors, in the same order.")
    hint = ""
    if "NoneType" in error:
        hint = (" A parameter has .grad None — the frozen layer (requires_grad=False). Skip it: "
                "`if p.grad is None: continue`.")
    return Case(name, False, f"rank {bad.rank} failed{where}: {bad.describe().rstrip('.')}.{hint}")


def _run_case(answer, mode: str, world_size: int, steps: int, lr: float):
    """(Case or None, flag): flag is "stub" for an unanswered exercise, "stop" after a deadlock."""
    name = f"{world_size} ranks"
    # gloo: every rank's gradients must cross its TCP sockets, where the kernel counts them
    res = run(_rank_case, world_size, args=(answer, mode, steps, lr), backend="gloo",
              timeout=TIMEOUT_S,
              deadline=TIMEOUT_S + 4.0, check=False, echo=False)
    if not res.ok:
        bad = res.first_failure()
        if "NotImplementedError" in (bad.error or ""):
            return None, "stub"
        case = _failure(name, bad)
        return case, "stop" if "deadlock" in case.detail else None
    values = res.values
    shards = [[values[r]["batches"][s] for r in range(world_size)] for s in range(steps)]
    oracle = oracle_history(world_size, steps, lr, init=values[0]["before"], shards=shards)
    problem = reference_problem([n for v in values for n in v["references"]]) or \
        _start_problem(values, mode) or _compare(world_size, values, oracle) or \
        _side_channel_problem(values)
    if problem is None and mode == "wrapper":
        problem = _overlap_problem(values, oracle)
    if problem:
        return Case(name, False, problem), None
    calls = sum(len(s["calls"]) for s in values[0]["steps"])
    return Case(name, True, f"every rank matches the oracle at all {steps} steps "
                f"({calls // steps} all_reduce calls per step)"), None


def _check(answer, mode: str, world_sizes, steps: int, lr: float) -> list[Case]:
    cases: list[Case] = []
    for ws in world_sizes:
        case, flag = _run_case(answer, mode, ws, steps, lr)
        if flag == "stub":    # lk.exercise reports "not done yet"
            raise NotImplementedError("the answer still raises NotImplementedError")
        cases.append(case)
        if flag == "stop":    # a deadlock costs TIMEOUT_S per case: one is enough to know
            cases += [Case(f"{w} ranks", False, "not run: fix the deadlock first")
                      for w in world_sizes[len(cases):]]
            break
    return cases


def check_average_gradients(fn, world_sizes=WORLD_SIZES, steps: int = STEPS,
                            lr: float = LR) -> list[Case]:
    """Grade ``fn(model)``, called in every rank after ``loss.backward()``, before the SGD step.

    The harness replicates the model (step 1) itself; ``fn`` must leave every rank's ``.grad``
    equal to the oracle's average. One :class:`~labkit.grading.exercise.Case` per world size;
    raises ``NotImplementedError`` while ``fn`` is the stub ("not done yet").

    Example::

        lk.exercise.check("02.average_gradients", average_gradients)
        # or directly: [c.passed for c in check_average_gradients(average_gradients)]
    """
    return _check(fn, "function", tuple(world_sizes), steps, lr)


def check_ddp_wrapper(cls, world_sizes=WORLD_SIZES, steps: int = STEPS,
                      lr: float = LR) -> list[Case]:
    """Grade an overlapping DDP class: ``cls(model)``, then ``.finish_gradient_synchronization()``.

    Every rank hands ``cls`` a model with its own weights and buffer: the wrapper must
    broadcast rank 0's (step 1). Besides matching the oracle on every rank at every step, every
    gradient must be all-reduced with ``dist.all_reduce(..., async_op=True)`` during backward,
    and every handle waited for in ``finish_gradient_synchronization``.
    """
    return _check(cls, "wrapper", tuple(world_sizes), steps, lr)

