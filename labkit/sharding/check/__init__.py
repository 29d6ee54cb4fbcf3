"""Notebook 06's exercise checkers: ZeRO-1 optimizer, ZeRO-3 layer, Megatron MLP (notebook 06 §5, §6, §11).

Stricter than the anchors (CS336's sharded-optimizer test passes a plain optimizer), and built
so that no shortcut passes (``tests/sharding/test_sharding_check.py`` feeds each one):

* every answer runs on **2 and 4 real ranks**; each rank draws its **weights and data from a
  secret of its own** (``os.urandom``, per grading) and the one-process oracle is built from
  what the ranks report, afterwards: ranks start from different weights (a missing broadcast
  fails), and an answer that imports the oracle or skips the communication has nothing to
  copy. **Every rank is compared at every step**;
* what a rank *holds* is counted over the whole rank process
  (:class:`~labkit.grading.integrity.Census`: closures, defaults, globals, tensor attributes,
  kept graphs), not over the answer's attributes, so state or a full weight kept anywhere
  fails; so does a library object (``ZeroRedundancyOptimizer``, ``DTensor`` ...) or a whole
  ordinary optimizer kept anywhere, and so does the lab's own implementation of the exercise
  run from the answer (``HandZero``, ``lk.sharding``'s Megatron layers:
  :mod:`labkit.grading.references`; the ring halves of §3 stay allowed);
* what it *sends* is counted at the dispatcher (:class:`~.counting.CommCounter`): ZeRO-1's
  reduce-scatter and all-gather of the flat parameters, ZeRO-3's three ring halves, Megatron's
  one all-reduce each way — whose **contents** must be this rank's own partial sums, so a rank
  that computes the whole MLP fails — from this thread, its helper threads and future
  callbacks. Data moved through the process group's store or a file is not communication
  the exercise asks for: the collectives are missing, or the sends carry decoys, and it fails;
* the ZeRO-1 model has a **frozen parameter** (its ``.grad`` stays ``None``), which must stay
  as it was, and the answer is also trained with SGD with momentum, because Adam's update barely
  changes when the gradient is scaled: a *summed* gradient would pass with Adam alone;
* short timeouts: a deadlocked answer fails in seconds. A case the checker cannot verify (the
  job failed, a value is missing, the census was tampered with) fails with the reason.

The quiz keys computed from the learner's own measurements (§16) are at the end: the bank
names them as ``key = "labkit.sharding.check:<fn>"`` with ``inputs`` = the notebook variables
they read, so a question about "your run" is scored against that run.
"""
from __future__ import annotations

import math

import torch

from ...grading.exercise import Case
from ...grading.references import reference_problem
from ...runtime import run
from ...runtime.pickling import dumps
from . import jobs as J
from . import oracles as O

__all__ = ["check_sharded_optimizer", "check_sharded_linear", "check_parallel_mlp"]

WORLD_SIZES = (2, 4)
TIMEOUT_S = 4.0
ATOL, RTOL = 1e-6, 1e-5


def _warm(rank: int, world_size: int) -> None:
    from ..counting import CommCounter
    with CommCounter():              # the first dispatch mode in a process imports torch._dynamo
        torch.zeros(1).add_(1)       # (seconds on a busy machine): not the answer's time


def _job(fn, world_size: int, answer, steps: int):
    """Run a checker job; (values, None) or (None, message) when it failed."""
    run(_warm, world_size, timeout=60.0, deadline=120.0, echo=False)   # ms when ranks are warm
    try:
        blob = dumps(answer)              # loaded in the ranks after the census's baseline
    except Exception as exc:  # noqa: BLE001
        return None, f"the answer cannot be sent to the ranks: {type(exc).__name__}: {exc}"
    res = run(J.watched, world_size, args=(fn.__name__, blob, steps), timeout=TIMEOUT_S,
              deadline=TIMEOUT_S + 20, check=False, echo=False)
    if res.ok:
        lab = reference_problem([n for v in res.values for n in v["references"]])
        return (None, lab) if lab else ([v["value"] for v in res.values], None)
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
    hint = (" The model has a frozen parameter (requires_grad=False): its .grad stays None, as "
            "with torch's optimizers, which skip it; leave it out." if "'NoneType'" in
            (bad.error or "") else "")
    return None, f"{bad.describe()} — the case cannot be verified, so it fails.{hint}"


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
PSI = sum(math.prod(s) for s in ((J.OPT_DIMS[1], J.OPT_DIMS[0]), (J.OPT_DIMS[1],),
                                 (J.OPT_DIMS[2], J.OPT_DIMS[1]), (J.OPT_DIMS[2],)))
FROZEN_NUMEL = J.OPT_DIMS[1]                         # fc1's bias
TRAINABLE = PSI - FROZEN_NUMEL


def _params_problem(values, name: str, n: int, steps: int) -> str | None:
    init, data = values[0][name]["init"], [v[name]["data"] for v in values]
    want = O.optimizer_oracle(name, init, data, steps)
    summed = O.optimizer_oracle(name, init, data, steps, "sum")
    for s in range(steps):
        got = [v[name]["params"][s] for v in values]
        for r in range(1, n):
            differ = [i for i, (a, b) in enumerate(zip(got[r], got[0])) if not torch.equal(a, b)]
            if differ == [J.FROZEN]:
                return (f"after step {s + 1}, rank {r}'s frozen parameter (fc1's bias, "
                        f"requires_grad=False) differs from rank 0's: Broadcast rank 0's "
                        f"parameters in __init__, the frozen ones too (every rank built its "
                        f"model from its own seed).")
            if differ:
                return (f"after step {s + 1}, rank {r}'s parameters differ from rank 0's: every "
                        f"rank must end each step with every updated slice (all-gather them "
                        f"into the parameters), starting from rank 0's weights.")
        for r in range(n):
            if all(_close(a, b) for a, b in zip(got[r], want[s])):
                continue
            if all(_close(a, b) for a, b in zip(got[r], summed[s])):
                return (f"after step {s + 1} rank {r} took {n}x the averaged step: you summed "
                        f"the gradients; divide by the world size (the loss is a mean).")
            if not torch.equal(got[r][J.FROZEN], init[J.FROZEN]):
                return (f"after step {s + 1}, rank {r}'s frozen parameter (fc1's bias, "
                        f"requires_grad=False, .grad None) is not rank 0's initial value: "
                        f"broadcast every parameter, then leave frozen ones out of the flat "
                        f"layout and never change them, as torch's optimizers do.")
            diff = max(float((a - b).abs().max()) for a, b in zip(got[r], want[s]))
            return (f"after step {s + 1}, rank {r}'s parameters differ from one process by up "
                    f"to {diff:.3g}. Broadcast rank 0's parameters in __init__ (every rank "
                    f"built its model from its own secret seed), average the gradients, update "
                    f"your slice and all-gather. {J.COPY}")
    return None


def _state_problem(values, n: int) -> str | None:
    k, k_all = -(-TRAINABLE // n), -(-PSI // n)
    limit, floor = 3 * k_all + 16, 2 * (TRAINABLE // n) - 16   # Adam: 2 moments + a slice
    for r, v in enumerate(values):
        for s, census in enumerate(v["Adam"]["census"]):
            problem = J.census_problem(census, r, f"after step {s + 1}")
            if problem:
                return problem
            got = census["held"]
            if got > limit:
                return (f"rank {r}'s process holds {got} elements besides the model, its "
                        f"gradients and the checker's data (counted over every live tensor "
                        f"of the rank, wherever it is kept: attributes, closures, globals); "
                        f"sharded, Adam needs about 2·⌈Ψ/N⌉ = {2 * k} (+ your slice, {k}): at "
                        f"most {limit}. A plain Adam holds 2Ψ = {2 * TRAINABLE}. Keep state "
                        f"for your 1/N slice only (split the flat parameters into N equal "
                        f"slices).")
            whole = [(cls, m) for cls, m in census["optimizers"] if m > k_all + 8]
            if whole:
                cls, m = whole[0]
                return (f"rank {r} holds an optimizer ({cls}) with state for {m} parameter "
                        f"elements, more than a 1/{n} slice ({k}): a whole ordinary optimizer, "
                        f"wherever it is kept (an attribute, a closure), is not ZeRO-1. Give "
                        f"the inner optimizer your slice only.")
            if got < floor:
                return (f"rank {r} holds only {got} elements of state, less than Adam needs "
                        f"for a 1/{n} slice ({2 * (TRAINABLE // n)}): keep the inner optimizer "
                        f"(and its state) between steps.")
    return None


def _collectives_problem(values, n: int) -> str | None:
    """Each step: one reduce-scatter of the flat gradients and one all-gather of the flat
    parameters (each ≥ 4·Ψ bytes, at most one parameter's padding more per parameter)."""
    low, high = 4 * TRAINABLE, 4 * (PSI + n * 4)
    for name in J.OPT_SETUPS:
        for r, v in enumerate(values):
            for s, comm in enumerate(v[name]["comm"]):
                rs, ag = comm["reduce_scatter"], comm["all_gather"]
                if rs == 0 and comm["all_reduce"]:
                    return (f"{name}, step {s + 1}: rank {r} all-reduced {comm['all_reduce']} "
                            f"bytes and reduce-scattered 0: every rank received the sum of "
                            f"every slice, though it updates only its own. ZeRO-1 "
                            f"reduce-scatters the flat gradients, so each rank receives the "
                            f"sum of its slice: on NCCL half an all-reduce's traffic (an "
                            f"all-reduce plus the all-gather send 3Ψ, ZeRO-1 2Ψ). gloo runs a "
                            f"reduce-scatter as a whole all-reduce, so only a backend with a "
                            f"real reduce-scatter (NCCL) saves the bytes; ask for it anyway.")
                if rs == 0 or ag == 0:
                    return (f"{name}, step {s + 1}: rank {r} reduce-scattered {rs} and "
                            f"all-gathered {ag} bytes. ZeRO-1 averages the gradients with a "
                            f"reduce-scatter and shares the updated slices with an all-gather, "
                            f"every step, in this thread. Numbers got without them were "
                            f"computed some other way: a copied oracle, or data moved by a "
                            f"side channel (another thread, the process group's store, a "
                            f"file) — neither counts.")
                if not (low <= rs <= high and low <= ag <= high):
                    return (f"{name}, step {s + 1}: rank {r} reduce-scattered {rs} and "
                            f"all-gathered {ag} bytes; the {TRAINABLE} trainable elements "
                            f"flattened and padded are {4 * TRAINABLE}-{high} bytes each way.")
                extra = [k for k in ("all_reduce", "broadcast", "send") if comm[k]]
                if extra:
                    return (f"{name}, step {s + 1}: rank {r} also sent {', '.join(extra)} "
                            f"({sum(comm[k] for k in extra)} bytes): ZeRO-1's step moves each "
                            f"gradient once (reduce-scatter) and each parameter once "
                            f"(all-gather), nothing more.")
    return None


def check_sharded_optimizer(cls, world_sizes=WORLD_SIZES, steps: int = 3) -> list[Case]:
    """Grade ``cls(params, optimizer_class, **defaults)`` with ``.step()`` (ZeRO-1).

    ``params`` are an MLP's, one of them frozen (``requires_grad=False``). The checker calls
    ``step()`` after each ``loss.backward()`` (the gradients are this rank's own, not averaged)
    and sets every ``.grad`` to ``None`` after it.
    """
    def names(n):
        return [f"{n} ranks, SGD with momentum: every rank matches one process every step, "
                f"the frozen parameter unchanged",
                f"{n} ranks, Adam: every rank matches one process every step",
                f"{n} ranks, Adam: each rank's process holds about 1/{n} of the state",
                f"{n} ranks: by hand, one reduce-scatter and one all-gather per step"]

    def judge(values, n):
        return [_params_problem(values, "SGD with momentum", n, steps),
                _params_problem(values, "Adam", n, steps), _state_problem(values, n),
                _collectives_problem(values, n)]
    return _grade(J.optimizer_job, cls, world_sizes, steps, names, judge)


# ------------------------------------------------------------- exercise 2: ZeRO-3 layer
def _linear_numbers(values, n: int, steps: int) -> str | None:
    want = O.linear_oracle(values[0]["init"], [v["data"] for v in values], steps)
    for s in range(steps):
        for r in range(n):
            got, w = values[r]["records"][s], want[s]
            if not torch.equal(got["out"], w["out"][r]):
                if s == 0:
                    return (f"step 1, rank {r}: the output differs from one process. The "
                            f"gathered weight is not rank 0's layer: broadcast it before "
                            f"sharding (each rank built its own), and put the shards "
                            f"together in rank order. {J.COPY}")
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
        if v["shard_shape"] != (k,):
            return (f"rank {r}: self.shard has shape {v['shard_shape']}; a 1/{n} shard of the "
                    f"{full} flattened, padded elements has ({k},).")
        if v["shard_storage"] > k:
            return (f"rank {r}: self.shard is a view into a buffer of {v['shard_storage']} "
                    f"elements, so the full parameter is still held: clone your slice.")
        if v["params"] != [(k,)]:
            return (f"rank {r}: the wrapper's parameters are {v['params']}; only the shard may "
                    f"be one (a kept nn.Linear keeps the full weight).")
        for s, rec in enumerate(v["records"]):
            census = rec["census"]
            problem = J.census_problem(census, r, f"after step {s + 1}")
            if problem:
                return problem
            if census["held"] >= full:
                return (f"rank {r}: after step {s + 1} the rank process holds {census['held']} "
                        f"elements besides the shard and the checker's data (counted over "
                        f"every live tensor, wherever it is kept: attributes, a closure, the "
                        f"autograd context, a global), as much as the full parameter "
                        f"({full}): free the gathered weight after use instead of keeping it.")
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
            if rec["sent"] == 0:
                return (f"step {s + 1}, rank {r} sent nothing from this thread, yet ZeRO-3 "
                        f"needs the other ranks' shards: the collectives ran where they are "
                        f"not counted (another thread) or the data went by a side channel "
                        f"(the process group's store, a file). Send with the ring halves, in "
                        f"forward and backward ({want} bytes per step).")
            if rec["sent"] == 2 * (n - 1) * k * 4:
                return (f"step {s + 1}, rank {r} sent {rec['sent']} bytes: two ring halves, "
                        f"not three. ZeRO-3 frees the full weight after forward and gathers it "
                        f"again in backward (all-gather, all-gather, reduce-scatter = {want}).")
            if rec["sent"] != want:
                return (f"step {s + 1}, rank {r} sent {rec['sent']} bytes; two all-gathers and "
                        f"one reduce-scatter of {k * n * 4} bytes on a ring send {want}.")
            shards = [v2["records"][s]["shard"] for v2 in values]
            carried = sum(any(torch.equal(t.reshape(-1), sh) for sh in shards)
                          for t in rec["sends"] if t.numel() == k)
            if carried < 2 * (n - 1):
                return (f"step {s + 1}, rank {r}: {carried} of its sends carried a rank's "
                        f"shard; the two ring all-gathers forward {2 * (n - 1)} shards. Sends "
                        f"of the right size that carry something else are decoys: the data "
                        f"went another way (another thread, the process group's store, a "
                        f"file) or were never needed (a copied result).")
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
    from .mlp import mlp_comm, mlp_held, mlp_numbers, mlp_shapes

    def names(n):
        return [f"{n} ranks: output, input gradient and every weight gradient match one "
                f"process, every rank and step",
                f"{n} ranks: fc1 split by output rows, fc2 by input columns (1/{n} each), "
                f"nothing more held",
                f"{n} ranks: hand-written, one all-reduce of this rank's partial sums forward "
                f"and one backward"]

    def judge(values, n):
        oracle = O.mlp_oracle(n, values[0]["init"], values[0]["data"], steps)
        shapes = mlp_shapes(values, n)      # the slices cannot be compared with wrong shapes
        return [shapes or mlp_numbers(values, n, steps, oracle), shapes or mlp_held(values, n),
                mlp_comm(values, n, oracle)]
    return _grade(J.mlp_job, cls, world_sizes, steps, names, judge)
