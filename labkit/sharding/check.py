"""Notebook 06's exercise checkers: ZeRO-1 optimizer, ZeRO-3 layer, Megatron MLP (notebook 06 §12).

Stricter than the anchors (CS336's sharded-optimizer test passes a plain optimizer):

* every answer runs on **2 and 4 real ranks** that start from **different weights** (a missing
  broadcast fails), and **every rank is compared at every step** with one process;
* what the answer *holds* is read from storages, whatever its attributes are called, so a
  plain optimizer, an unsharded layer or a kept full weight fails its own case;
* what it *sends* is counted at the dispatcher (:class:`~.counting.CommCounter`), so ZeRO-3's
  second all-gather, Megatron's one all-reduce each way and "hand-written, not torch's" are
  checked, not assumed;
* the ZeRO-1 answer is also trained with SGD with momentum, because Adam's update barely changes
  when the gradient is scaled: a *summed* gradient would pass with Adam alone;
* short timeouts: a deadlocked answer fails in seconds. A case the checker cannot verify (the
  job failed, a value is missing) fails with the reason.

The quiz keys computed from the learner's own measurements (§13) are at the end: the bank
names them as ``key = "labkit.sharding.check:<fn>"`` with ``inputs`` = the notebook variables
they read, so a question about "your run" is scored against that run.
"""
from __future__ import annotations

import math

import torch

from ..grading.exercise import Case
from ..runtime import run
from . import _check_jobs as J
from . import _check_oracles as O

__all__ = ["check_sharded_optimizer", "check_sharded_linear", "check_parallel_mlp",
           "ddp_bytes_per_param", "zero3_traffic_ratio", "zero1_state_fraction"]

WORLD_SIZES = (2, 4)
TIMEOUT_S = 4.0
ATOL, RTOL = 1e-6, 1e-5


def _warm(rank: int, world_size: int) -> None:
    from .counting import CommCounter
    with CommCounter():              # the first dispatch mode in a process imports torch._dynamo
        torch.zeros(1).add_(1)       # (seconds on a busy machine): not the answer's time


def _job(fn, world_size: int, answer, steps: int):
    """Run a checker job; (values, None) or (None, message) when it failed."""
    run(_warm, world_size, timeout=60.0, deadline=120.0, echo=False)   # ms when ranks are warm
    res = run(fn, world_size, args=(answer, steps), timeout=TIMEOUT_S, deadline=TIMEOUT_S + 20,
              check=False, echo=False)
    if res.ok:
        return res.values, None
    bad = res.first_failure()
    if bad.status == "raised" and (bad.error or "").startswith("NotImplementedError"):
        raise NotImplementedError("the answer still raises NotImplementedError")
    if "Timed out" in (bad.error or ""):
        return None, (f"rank {bad.rank} waited more than {TIMEOUT_S:.0f} s in a collective: a "
                      f"deadlock. Every rank must issue the same collectives in the same order.")
    if bad.status == "hung":
        return None, (f"rank {bad.rank} was still running after {TIMEOUT_S + 20:.0f} s (stuck in "
                      f"{bad.where or 'your code'}): an endless loop, or a deadlock. Every rank "
                      f"must issue the same collectives in the same order.")
    return None, f"{bad.describe()} — the case cannot be verified, so it fails."


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _grade(job, cls, world_sizes, steps: int, names, judge) -> list[Case]:
    """Per world size: run ``job``, then one case per name, ``judge(values, n)`` giving each
    case's problem (``None``: passed, with the detail "every rank, every step")."""
    cases = []
    for n in world_sizes:
        values, why = _job(job, n, cls, steps)
        if why is None:
            why = next((v["error"] for v in values if "error" in v), None)
        problems = [why] * len(names(n)) if why else judge(values, n)
        cases += [Case(name, p is None, p or "every rank, every step")
                  for name, p in zip(names(n), problems)]
    return cases


# ------------------------------------------------------------- exercise 1: ZeRO-1 optimizer
def _params_problem(values, name: str, n: int, steps: int) -> str | None:
    want = O.optimizer_oracle(n, name, steps)
    summed = O.optimizer_oracle(n, name, steps, "sum")
    for s in range(steps):
        got = [v[name]["params"][s] for v in values]
        for r in range(1, n):
            if not all(torch.equal(a, b) for a, b in zip(got[r], got[0])):
                return (f"after step {s + 1}, rank {r}'s parameters differ from rank 0's: every "
                        f"rank must end each step with every updated slice (all-gather them "
                        f"into the parameters), starting from rank 0's weights.")
        for r in range(n):
            if all(_close(a, b) for a, b in zip(got[r], want[s])):
                continue
            if all(_close(a, b) for a, b in zip(got[r], summed[s])):
                return (f"after step {s + 1} rank {r} took {n}x the averaged step: you summed "
                        f"the gradients; divide by the world size (the loss is a mean).")
            diff = max(float((a - b).abs().max()) for a, b in zip(got[r], want[s]))
            return (f"after step {s + 1}, rank {r}'s parameters differ from one process by up "
                    f"to {diff:.3g}. Broadcast rank 0's parameters in __init__ (every rank "
                    f"built its model from a different seed), average the gradients, update "
                    f"your slice and all-gather.")
    return None


def _state_problem(values, n: int) -> str | None:
    psi = sum(math.prod(s) for s in ((J.OPT_DIMS[1], J.OPT_DIMS[0]), (J.OPT_DIMS[1],),
                                     (J.OPT_DIMS[2], J.OPT_DIMS[1]), (J.OPT_DIMS[2],)))
    k = -(-psi // n)
    limit, floor = 3 * k + 16, 2 * (psi // n) - 16        # Adam: 2 moments (+ a slice copy)
    for r, v in enumerate(values):
        got = max(v["Adam"]["state"])
        if v["Adam"]["library"]:
            return (f"rank {r}'s optimizer wraps {', '.join(v['Adam']['library'])}: this "
                    f"exercise asks you to shard by hand.")
        if got > limit:
            return (f"rank {r}'s optimizer holds {got} elements besides the parameters and "
                    f"gradients; sharded, Adam needs about 2·⌈Ψ/N⌉ = {2 * k} (+ your slice, "
                    f"{k}): at most {limit}. A plain Adam holds 2Ψ = {2 * psi}. Keep state for "
                    f"your 1/N slice only (split the flat parameters into N equal slices).")
        if got < floor:
            return (f"rank {r}'s optimizer holds only {got} elements of state, less than Adam "
                    f"needs for a 1/{n} slice ({2 * (psi // n)}): keep the inner optimizer "
                    f"(and its state) as an attribute of your optimizer.")
    return None


def check_sharded_optimizer(cls, world_sizes=WORLD_SIZES, steps: int = 3) -> list[Case]:
    """Grade ``cls(params, optimizer_class, **defaults)`` with ``.step()`` (ZeRO-1).

    The checker calls ``step()`` after each ``loss.backward()`` (the gradients are this rank's
    own, not averaged) and sets every ``.grad`` to ``None`` after it.
    """
    def names(n):
        return [f"{n} ranks, SGD with momentum: every rank matches one process every step",
                f"{n} ranks, Adam: every rank matches one process every step",
                f"{n} ranks, Adam: each rank's optimizer state is about 1/{n}"]

    def judge(values, n):
        return [_params_problem(values, "SGD with momentum", n, steps),
                _params_problem(values, "Adam", n, steps), _state_problem(values, n)]
    return _grade(J.optimizer_job, cls, world_sizes, steps, names, judge)


# ------------------------------------------------------------- exercise 2: ZeRO-3 layer
def _linear_numbers(values, n: int, steps: int) -> str | None:
    want = O.linear_oracle(n, steps)
    for s in range(steps):
        for r in range(n):
            got, w = values[r]["records"][s], want[s]
            if not torch.equal(got["out"], w["out"][r]):
                if s == 0:
                    return (f"step 1, rank {r}: the output differs from one process. The "
                            f"gathered weight is not rank 0's layer: broadcast it before "
                            f"sharding (each rank built its own), and put the shards together "
                            f"in rank order.")
                return (f"step {s + 1}, rank {r}: the output uses stale weights: gather the "
                        f"*current* shards in every forward (the checker updated them).")
            g, wg = got["shard_grad"], w["shard_grad"][r]
            if g is None:
                return (f"step {s + 1}, rank {r}: self.shard has no gradient after backward: "
                        f"return the reduce-scattered gradient for the shard from backward.")
            if not torch.equal(g, wg):
                if torch.equal(g, wg * n):
                    return (f"step {s + 1}, rank {r}: the shard's gradient is {n}x one "
                            f"process's: you summed; divide the reduce-scattered gradient "
                            f"by the world size.")
                if torch.equal(g, w["local"][r]):
                    return (f"step {s + 1}, rank {r}: the shard's gradient is this rank's own: "
                            f"reduce-scatter the full gradient so each shard gets every "
                            f"rank's contribution.")
                close = _close(g, wg)
                return (f"step {s + 1}, rank {r}: the shard's gradient differs from one "
                        f"process" + (" (close, but not bit for bit: the checker's data are "
                                      "exact in fp32, so a right answer matches exactly)"
                                      if close else "") + ".")
            if not torch.equal(got["x_grad"], w["x_grad"][r]):
                return (f"step {s + 1}, rank {r}: the input's gradient differs: in backward, "
                        f"gather the full weight again and compute grad_out @ W.")
    return None


def _linear_memory(values, n: int) -> str | None:
    full = J.LINEAR[0] * J.LINEAR[1] + J.LINEAR[1]
    k = -(-full // n)
    for r, v in enumerate(values):
        if v["library"]:
            return f"rank {r}: the wrapper uses {', '.join(v['library'])}: shard it by hand."
        if v["shard_shape"] != (k,):
            return (f"rank {r}: self.shard has shape {v['shard_shape']}; a 1/{n} shard of the "
                    f"{full} flattened, padded elements has ({k},).")
        if v["shard_storage"] > k:
            return (f"rank {r}: self.shard is a view into a buffer of {v['shard_storage']} "
                    f"elements, so the full parameter is still held: clone your slice.")
        if v["params"] != [(k,)]:
            return (f"rank {r}: the wrapper's parameters are {v['params']}; only the shard may "
                    f"be one (a kept nn.Linear keeps the full weight).")
        held = max(rec["held"] for rec in v["records"])
        if held >= full:
            return (f"rank {r}: between steps the wrapper holds {held} elements besides its "
                    f"shard, the size of the full parameter ({full}): free the gathered "
                    f"weight after use instead of keeping it.")
    return None


def _linear_traffic(values, n: int) -> str | None:
    k = -(-(J.LINEAR[0] * J.LINEAR[1] + J.LINEAR[1]) // n)
    want = 3 * (n - 1) * k * 4
    for r, v in enumerate(values):
        for s, rec in enumerate(v["records"]):
            library = sorted(set(rec["kinds"]) - {"send", "recv"})
            if library:
                return (f"step {s + 1}, rank {r} called {', '.join(library)} (a library "
                        f"collective): this exercise asks for the ring's halves — "
                        f"lk.sharding.ring_all_gather / ring_reduce_scatter, or your own "
                        f"isend/irecv.")
            if rec["sent"] == 2 * (n - 1) * k * 4:
                return (f"step {s + 1}, rank {r} sent {rec['sent']} bytes: two ring halves, "
                        f"not three. ZeRO-3 frees the full weight after forward and gathers it "
                        f"again in backward (all-gather, all-gather, reduce-scatter = {want}).")
            if rec["sent"] != want:
                return (f"step {s + 1}, rank {r} sent {rec['sent']} bytes; two all-gathers and "
                        f"one reduce-scatter of {k * n * 4} bytes on a ring send {want}.")
    return None


def check_sharded_linear(cls, world_sizes=(4, 2), steps: int = 3) -> list[Case]:
    """Grade ``cls(linear)``: a ZeRO-3 ``nn.Linear(6, 5)`` keeping only ``self.shard``.

    4 ranks first: after exercise 1's check (2, then 4 ranks) the warm 4-rank pool is reused,
    one rank pool started less (each start costs most of a second on a busy machine)."""
    def names(n):
        return [f"{n} ranks: output and gradients bit-exact vs one process, every rank and step",
                f"{n} ranks: only the 1/{n} shard is kept between steps",
                f"{n} ranks: hand-written ring collectives, ZeRO-3's traffic"]

    def judge(values, n):
        return [_linear_numbers(values, n, steps), _linear_memory(values, n),
                _linear_traffic(values, n)]
    return _grade(J.linear_job, cls, world_sizes, steps, names, judge)


# ------------------------------------------------------------- exercise 3: Megatron MLP
def check_parallel_mlp(cls, world_sizes=WORLD_SIZES, steps: int = 2) -> list[Case]:
    """Grade ``cls(mlp)`` for ``mlp = Sequential(Linear(6, 8), Tanh(), Linear(8, 5))``: a
    column-parallel ``fc1`` and a row-parallel ``fc2``, the full output on every rank."""
    from ._check_mlp import mlp_comm, mlp_numbers, mlp_shapes

    def names(n):
        return [f"{n} ranks: output, input gradient and every weight gradient match one "
                f"process, every rank and step",
                f"{n} ranks: fc1 split by output rows, fc2 by input columns (1/{n} each)",
                f"{n} ranks: hand-written, one all-reduce forward and one backward"]

    def judge(values, n):
        shapes = mlp_shapes(values, n)      # the slices cannot be compared with wrong shapes
        return [shapes or mlp_numbers(values, n, steps), shapes, mlp_comm(values, n)]
    return _grade(J.mlp_job, cls, world_sizes, steps, names, judge)


# ------------------------------------------------------------- quiz keys (§13)
def _rank0_setups(runs, name: str, needs: tuple[str, ...]) -> dict[str, dict]:
    if not isinstance(runs, (list, tuple)) or not runs or not isinstance(runs[0], (list, tuple)):
        raise ValueError(f"{name} should be lk.run(lk.sharding.run_setups, ...).values (a list "
                         f"per rank of setup results); run the cell that measures it first.")
    by_setup = {r.get("setup"): r for r in runs[0] if isinstance(r, dict)}
    missing = [s for s in needs if s not in by_setup]
    if missing:
        raise ValueError(f"{name} has no {', '.join(missing)} run: measure "
                         f"{', '.join(needs)} in the same job.")
    return by_setup


def ddp_bytes_per_param(ddp_mem) -> float:
    """Bytes per parameter rank 0 held under DDP + Adam: measured total / Ψ."""
    if not isinstance(ddp_mem, (list, tuple)) or not ddp_mem or "measured" not in ddp_mem[0]:
        raise ValueError("ddp_mem should be lk.run(lk.sharding.ddp_memory, ...).values; run the "
                         "cell of §1 that measures it first.")
    first = ddp_mem[0]
    return first["measured"]["total"] / first["psi"]


def zero3_traffic_ratio(zero2) -> float:
    """Bytes ZeRO-3 sent per step divided by what DDP sent, both counted in the learner's run."""
    s = _rank0_setups(zero2, "zero2", ("DDP", "ZeRO-3"))
    return s["ZeRO-3"]["ring_sent"] / s["DDP"]["ring_sent"]


def zero1_state_fraction(zero4) -> float:
    """Optimizer-state bytes of a ZeRO-1 rank over a DDP rank's, in the learner's 4-rank run."""
    s = _rank0_setups(zero4, "zero4", ("DDP", "ZeRO-1"))
    return s["ZeRO-1"]["memory"]["optimizer"] / s["DDP"]["memory"]["optimizer"]
