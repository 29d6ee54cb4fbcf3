"""Exercise 3's comparisons (notebook 06 §11): the Megatron MLP against one process.

Used by :func:`labkit.sharding.check.check_parallel_mlp`, with the oracle built from what the
ranks reported (:func:`labkit.sharding.check.oracles.mlp_oracle`). Each function returns
``None`` when every rank is right at every step, else one sentence naming the rank, the step,
the likely mistake (or shortcut) and its fix.
"""
from __future__ import annotations

import torch

from .jobs import COPY, MLP_BATCH, MLP_DIMS, census_problem

ATOL, RTOL = 1e-6, 1e-5
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
SLACK = 16                      # elements a rank may hold beyond its slices (counters, floats)


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _shards(n: int) -> dict[str, tuple]:
    d_in, hidden, d_out = MLP_DIMS
    k = hidden // n
    return {"fc1.weight": (k, d_in), "fc1.bias": (k,), "fc2.weight": (d_out, k),
            "fc2.bias": (d_out,)}


def mlp_shapes(values, n: int) -> str | None:
    """The parameters are the 1/N slices."""
    hidden = MLP_DIMS[1]
    if hidden % n:
        return f"the hidden width {hidden} does not split over {n} ranks (a checker bug)."
    k, want = hidden // n, _shards(n)
    for r, v in enumerate(values):
        missing = [name for name in NAMES if name not in v["shapes"]]
        if missing:
            return (f"rank {r}: the module has no {', '.join(missing)}; expose the two layers "
                    f"as self.fc1 and self.fc2, each with .weight and .bias (parameters found: "
                    f"{sorted(v['shapes'])}).")
        extra = sorted(set(v["shapes"]) - set(NAMES))
        if extra:
            return (f"rank {r}: the module also holds {', '.join(extra)}: keep only the two "
                    f"split layers (a kept full MLP holds every weight on every rank).")
        for name, shape in want.items():
            if v["shapes"][name] != shape:
                return (f"rank {r}: {name} has shape {v['shapes'][name]}, expected {shape}: "
                        f"fc1 keeps rows {r}·{k}..{(r + 1) * k} of the weight (output "
                        f"features), fc2 the same columns (input features), the full bias.")
    return None


def mlp_held(values, n: int) -> str | None:
    """The rank process holds nothing more than its slices (counted over every live tensor)."""

    allowed = sum(torch.Size(s).numel() for s in _shards(n).values()) + SLACK
    full = sum(a * b + b for a, b in zip(MLP_DIMS[:-1], MLP_DIMS[1:]))
    for r, v in enumerate(values):
        for s, rec in enumerate(v["records"]):
            census = rec["census"]
            problem = census_problem(census, r, f"after step {s + 1}")
            if problem:
                return problem
            if census["held"] > allowed:
                return (f"rank {r}: after step {s + 1} the rank process holds "
                        f"{census['held']} elements besides the checker's data (counted over "
                        f"every live tensor, wherever it is kept: a closure, an attribute, a "
                        f"global); its slices are {allowed - SLACK} (the full MLP: {full}). "
                        f"Keep only this rank's slices: a rank that keeps (and computes with) "
                        f"the whole MLP is not tensor-parallel.")
    return None


def mlp_numbers(values, n: int, steps: int, want: list[dict]) -> str | None:

    for s in range(steps):
        w = want[s]
        for r in range(n):
            got = values[r]["records"][s]
            if not _close(got["out"], w["out"]):
                if _close(got["out"], w["out"] + (n - 1) * w["bias2"]):
                    return (f"step {s + 1}, rank {r}: the output has fc2's bias {n} times: "
                            f"add it once, after the all-reduce of the partial sums.")
                return (f"step {s + 1}, rank {r}: the output differs from one process. Broadcast "
                        f"rank 0's MLP before slicing it (every rank built its own), and "
                        f"all-reduce the partial outputs of fc2. {COPY}")
            grads = got["grads"]
            if _close(grads["fc1.weight"], n * w["grads"][r]["fc1.weight"]):
                return (f"step {s + 1}, rank {r}: fc1's gradients are {n}x one process's: the "
                        f"all-reduce of your forward also all-reduces in backward "
                        f"(torch.distributed.nn.functional.all_reduce does that). Megatron's g "
                        f"is an autograd.Function whose backward is the identity.")
            for name in NAMES:
                if not _close(grads[name], w["grads"][r][name]):
                    return (f"step {s + 1}, rank {r}: the gradient of {name} differs from the "
                            f"matching slice of one process's.")
            if not _close(got["x_grad"], w["x_grad"]):
                if _close(got["x_grad"], w["partial_x_grad"][r]):
                    return (f"step {s + 1}, rank {r}: x.grad is only this rank's part of the "
                            f"input's gradient: Megatron's f all-reduces it in backward.")
                return (f"step {s + 1}, rank {r}: the input's gradient differs from one "
                        f"process.")
    return None


def mlp_comm(values, n: int, want: list[dict]) -> str | None:
    """One all-reduce each way, carrying this rank's own partial sums: batch × d_out forward
    (``h_r · W2_rᵀ``), batch × d_in backward (``grad_pre_r · W1_r``)."""

    d_in, _, d_out = MLP_DIMS
    shapes = {"forward": (MLP_BATCH, d_out), "backward": (MLP_BATCH, d_in)}
    for r, v in enumerate(values):
        for s, rec in enumerate(v["records"]):
            problem = census_problem(rec["census"], r, f"after step {s + 1}")
            if problem:
                return problem.replace("by hand, not with torch's library",
                                       "by hand, not with parallelize_module")
            for phase in ("forward", "backward"):
                if rec[phase] != ["all_reduce"]:
                    extra = (" (nothing counted: a collective run from another thread, or "
                             "data moved through the process group's store or a file, is a "
                             "side channel and does not count)" if not rec[phase] else "")
                    return (f"step {s + 1}, rank {r}: the {phase} issued "
                            f"{rec[phase] or 'no collective'}{extra}; Megatron's MLP does "
                            f"exactly one all_reduce in forward (g) and one in backward (f).")
                problem = _payload_problem(rec["payloads"][phase], want[s], phase, r, s,
                                           shapes[phase])
                if problem:
                    return problem
    return None


def _payload_problem(payloads, w: dict, phase: str, r: int, s: int, shape) -> str | None:
    what = ("its partial output h_r · W2_rᵀ (batch × d_out)" if phase == "forward" else
            "its part of the input's gradient (batch × d_in)")
    oracle = w["partial_out" if phase == "forward" else "partial_x_grad"][r]
    got = payloads[0] if payloads else None
    if got is None or tuple(got.shape) != shape:
        return (f"step {s + 1}, rank {r}: the {phase} all-reduce carried "
                f"{'nothing seen' if got is None else tuple(got.shape)}, not "
                f"{shape}: it must carry {what}, not weights or anything else.")
    if not _close(got, oracle):
        return (f"step {s + 1}, rank {r}: the {phase} all-reduce carried {shape} values that "
                f"are not this rank's own: it must carry {what}, computed with this rank's "
                f"slices only. A rank that computes the whole MLP and all-reduces a share of "
                f"it is not tensor-parallel.")
    return None
