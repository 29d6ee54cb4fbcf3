"""The "build DDP by hand" exercise checker: gradient averaging against a single-process oracle.

Graded in the style of Stanford CS336 assignment 2, but stricter:

* the model has the traps: a **frozen** parameter (``.grad`` is ``None``),
  **tied** weights (embedding = output layer, one parameter used twice), and a
  **mean** loss, so summing the gradients instead of averaging them fails;
* **every rank is compared at every step** (gradients after your sync, and
  parameters after the optimizer step), not just rank 0 at the end;
* **2, 3 and 4 ranks**, and the last batch is **uneven** (ranks get 3, 2, 3, 2
  examples) — DDP then averages each rank's mean-loss gradient, which is what
  the oracle computes too;
* **short timeouts**: an answer that deadlocks (a collective only some ranks
  call) fails in seconds, naming the rank and where it was stuck.

The oracle is one process that holds the whole batch and computes
``mean over ranks of (mean loss on that rank's shard)`` — exactly what
``torch.nn.parallel.DistributedDataParallel`` computes (tests/ddp/test_ddp.py
checks this).

Example::

    def average_gradients(model):
        ...                                  # your answer
    lk.exercise.check("02.average_gradients", average_gradients)   # per-case report
    cases = lk.ddp.check.check_average_gradients(average_gradients)  # list of exercise.Case
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..common.ranks import device
from ..grading.exercise import Case
from ..runtime import run

__all__ = ["TiedTiny", "shard_batches", "oracle_history", "check_average_gradients",
           "check_ddp_wrapper", "WORLD_SIZES"]

WORLD_SIZES = (2, 3, 4)
STEPS, LR, SEED, BATCH = 3, 0.5, 1234, 4
TIMEOUT_S = 3.0          # a collective waiting longer than this is a deadlock here
ATOL, RTOL = 1e-5, 1e-4


class TiedTiny(nn.Module):
    """A tiny next-token model with the traps: tied embedding/output weights and a frozen layer."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight          # tied: one parameter, used twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(dim=1)
        h = torch.tanh(self.hidden(torch.tanh(self.frozen(h))))
        return self.head(h)


def shard_batches(world_size: int, steps: int = STEPS, batch: int = BATCH,
                  seed: int = SEED) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (tokens, targets)``; the last step is uneven (3, 2, 3, 2 ... examples)."""
    g = torch.Generator().manual_seed(seed + world_size)
    out = []
    for step in range(steps):
        sizes = [batch] * world_size if step < steps - 1 else \
            [batch - 1 - (r % 2) for r in range(world_size)]
        out.append([(torch.randint(0, 11, (n, 3), generator=g),
                     torch.randint(0, 11, (n,), generator=g)) for n in sizes])
    return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sgd_step(model: nn.Module, lr: float) -> None:
    # Plain SGD by hand: torch.optim's first use in a fresh process imports torch._dynamo
    # (seconds on 2 busy cores), which would dominate the grader's runtime.
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(p.grad, alpha=lr)


def oracle_history(world_size: int, steps: int = STEPS, lr: float = LR,
                   seed: int = SEED) -> list[dict]:
    """One process, whole batch: per step the averaged gradients, the local ones, the parameters."""
    torch.manual_seed(seed)
    model = TiedTiny()
    history = []
    for shards in shard_batches(world_size, steps, seed=seed):
        local = []
        for x, y in shards:                        # each rank's own gradient, for diagnosis
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            local.append(_grads(model))
        model.zero_grad()
        loss = sum(F.cross_entropy(model(x), y) for x, y in shards) / world_size
        loss.backward()
        grads = _grads(model)
        _sgd_step(model, lr)
        history.append({"grads": grads, "local": local, "params": _params(model)})
    return history


def _rank_case(rank: int, world_size: int, answer, mode: str, steps: int, lr: float,
               seed: int) -> dict:
    """Runs in every rank: train with the learner's answer, record everything, every step."""
    import torch.distributed as dist


    dev = device()
    torch.manual_seed(seed)                     # the harness replicates: same init everywhere
    model = TiedTiny().to(dev)
    calls: list[tuple[bool, bool]] = []         # (issued during backward, async)
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        # positional order: all_reduce(tensor, op, group, async_op)
        is_async = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        calls.append((torch._C._current_graph_task_id() != -1, bool(is_async)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        wrapped = answer(model) if mode == "wrapper" else model
        steps_out = []
        for shards in shard_batches(world_size, steps, seed=seed):
            x, y = (t.to(dev) for t in shards[rank])
            model.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            if mode == "wrapper":
                wrapped.finish_gradient_synchronization()
            else:
                answer(model)
            grads = _grads(model)
            _sgd_step(model, lr)
            steps_out.append({"grads": grads, "params": _params(model)})
    finally:
        dist.all_reduce = original
    return {"steps": steps_out, "calls": calls}


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
            return f"parameter `{name}` after the optimizer step differs from the oracle."
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


def _run_case(answer, mode: str, world_size: int, steps: int, lr: float, seed: int):
    """(Case or None, flag): flag is "stub" for an unanswered exercise, "stop" after a deadlock."""
    name = f"{world_size} ranks"
    res = run(_rank_case, world_size, args=(answer, mode, steps, lr, seed), timeout=TIMEOUT_S,
                 deadline=TIMEOUT_S + 4.0, check=False, echo=False)
    if not res.ok:
        bad = res.first_failure()
        if "NotImplementedError" in (bad.error or ""):
            return None, "stub"
        case = _failure(name, bad)
        return case, "stop" if "deadlock" in case.detail else None
    problem = _compare(world_size, res.values, oracle_history(world_size, steps, lr, seed))
    if problem:
        return Case(name, False, problem), None
    calls = res.values[0]["calls"]
    if mode == "wrapper" and not any(during and is_async for during, is_async in calls):
        return Case(name, False, "numbers are right, but no all_reduce was launched with "
                    "async_op=True during backward: there is no overlap. Launch it from a "
                    "gradient hook (register_post_accumulate_grad_hook)."), None
    return Case(name, True, f"every rank matches the oracle at all {steps} steps "
                f"({len(calls) // steps} all_reduce calls per step)"), None


def _check(answer, mode: str, world_sizes, steps: int, lr: float, seed: int) -> list[Case]:
    cases: list[Case] = []
    for ws in world_sizes:
        case, flag = _run_case(answer, mode, ws, steps, lr, seed)
        if flag == "stub":    # lk.exercise reports "not done yet"
            raise NotImplementedError("the answer still raises NotImplementedError")
        cases.append(case)
        if flag == "stop":    # a deadlock costs TIMEOUT_S per case: one is enough to know
            cases += [Case(f"{w} ranks", False, "not run: fix the deadlock first")
                      for w in world_sizes[len(cases):]]
            break
    return cases


def check_average_gradients(fn, world_sizes=WORLD_SIZES, steps: int = STEPS, lr: float = LR,
                            seed: int = SEED) -> list[Case]:
    """Grade ``fn(model)``, called in every rank after ``loss.backward()``, before the SGD step.

    One :class:`~labkit.grading.exercise.Case` per world size; raises ``NotImplementedError``
    while ``fn`` is the stub (``lk.exercise.check`` then says "not done yet").

    Example::

        lk.exercise.check("02.average_gradients", average_gradients)
        # or directly: [c.passed for c in check_average_gradients(average_gradients)]
    """
    return _check(fn, "function", tuple(world_sizes), steps, lr, seed)


def check_ddp_wrapper(cls, world_sizes=WORLD_SIZES, steps: int = STEPS, lr: float = LR,
                      seed: int = SEED) -> list[Case]:
    """Grade an overlapping DDP class: ``cls(model)``, then ``.finish_gradient_synchronization()``.

    Besides matching the oracle on every rank at every step, at least one
    ``dist.all_reduce(..., async_op=True)`` must be issued during backward.
    """
    return _check(cls, "wrapper", tuple(world_sizes), steps, lr, seed)
