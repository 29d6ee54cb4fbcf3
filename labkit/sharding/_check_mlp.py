"""Exercise 3's comparisons (notebook 06 §12.3): the Megatron MLP against one process.

Used by :func:`labkit.sharding.check.check_parallel_mlp`. Each function returns ``None`` when
every rank is right at every step, else one sentence naming the rank, the step, the likely
mistake and its fix.
"""
from __future__ import annotations

import torch

from . import _check_jobs as J
from . import _check_oracles as O

ATOL, RTOL = 1e-6, 1e-5
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def mlp_shapes(values, n: int) -> str | None:
    d_in, hidden, d_out = J.MLP_DIMS
    if hidden % n:
        return f"the hidden width {hidden} does not split over {n} ranks (a checker bug)."
    k = hidden // n
    want = {"fc1.weight": (k, d_in), "fc1.bias": (k,), "fc2.weight": (d_out, k),
            "fc2.bias": (d_out,)}
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


def mlp_numbers(values, n: int, steps: int) -> str | None:
    want = O.mlp_oracle(n, steps)
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
                        f"all-reduce the partial outputs of fc2.")
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


def mlp_comm(values, n: int) -> str | None:
    for r, v in enumerate(values):
        if v["library"]:
            return (f"rank {r}: the module uses {', '.join(v['library'])} (parallelize_module): "
                    f"this exercise asks for the column/row split by hand.")
        for s, rec in enumerate(v["records"]):
            for phase in ("forward", "backward"):
                if rec[phase] != ["all_reduce"]:
                    return (f"step {s + 1}, rank {r}: the {phase} issued "
                            f"{rec[phase] or 'no collective'}; Megatron's MLP does exactly one "
                            f"all_reduce in forward (g) and one in backward (f).")
    return None
