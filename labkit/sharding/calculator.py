"""Which to use when: bytes per rank and bytes sent per step, by setup (notebook 06 §1, §13).

The formulas of the ZeRO paper (Rajbhandari et al., SC 2020), for Ψ parameters on N ranks::

    setup          parameters  gradients          optimizer state  sent per step
    DDP            P·Ψ         G·Ψ (+ G·Ψ buckets) K·Ψ              2Ψ  all-reduce
    ZeRO-1         P·Ψ         G·Ψ                K·Ψ/N            2Ψ  reduce-scatter + all-gather
    ZeRO-2         P·Ψ         G·Ψ/N              K·Ψ/N            2Ψ
    ZeRO-3 / FSDP  P·Ψ/N       G·Ψ/N              K·Ψ/N            3Ψ  all-gather x2 + reduce-scatter

with bytes per element P (parameters), G (gradients), K (optimizer state). In fp32 with Adam
P = G = 4 and K = 8 (``exp_avg``, ``exp_avg_sq``): 16Ψ. **The ZeRO paper's mixed precision**
(``"mixed"``: fp16 parameters and gradients, an fp32 master copy and Adam's two moments) has
P = G = 2 and K = 12: also 16Ψ, and it communicates 2-byte elements. PyTorch's recipes are not
that scheme:

* DDP with ``torch.autocast`` keeps fp32 parameters, fp32 gradients and fp32 Adam state (the
  autocast casts are per op and temporary) and all-reduces fp32: its model state is the
  ``"fp32"`` row, 16Ψ plus 4Ψ of buckets;
* FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
  (``"bf16 policy"``) keeps fp32 shards (16Ψ/N), all-gathers bf16 parameters (2 bytes) and
  reduce-scatters fp32 gradients (4 bytes).

"Sent" is in the paper's units: elements times the communicated dtype's size, per collective
(gathers at ``gather`` bytes, reductions at ``reduce`` bytes); a ring puts ``(N-1)/N`` of it on
each rank's link. ``ZeroRedundancyOptimizer`` (torch) runs under DDP, so its gradients are
all-reduced (2Ψ) and the updated parameters broadcast (Ψ): 3Ψ.

Activations, temporary buffers and the allocator's slack are **not** in these numbers: they are
predictions of the model-state memory only, and the notebook labels them so.

Example::

    memory_per_rank(MODELS["GPT-2 XL"], 8, "ZeRO-3", "mixed")["total"] / 2**30   # 2.9 GiB
"""
from __future__ import annotations

from ..common.tables import Col, table

__all__ = ["SETUPS", "PRECISIONS", "MODELS", "gpt2_params", "memory_per_rank",
           "traffic_per_step", "plan", "plan_table", "compare"]

SETUPS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer")
# bytes per parameter element: params, grads, optimizer state, and what the gathers of
# parameters and the reductions of gradients send per element
PRECISIONS = {"fp32": {"params": 4, "grads": 4, "optimizer": 8, "gather": 4, "reduce": 4},
              "mixed": {"params": 2, "grads": 2, "optimizer": 12, "gather": 2, "reduce": 2},
              "bf16 policy": {"params": 4, "grads": 4, "optimizer": 8, "gather": 2, "reduce": 4}}
# per setup: (elements gathered, elements reduced) per step, in units of Ψ
_SENT = {"DDP": (0, 2), "ZeRO-1": (1, 1), "ZeRO-2": (1, 1), "ZeRO-3": (2, 1),
         "ZeroRedundancyOptimizer": (1, 2)}


def gpt2_params(n_layer: int, n_embd: int, vocab: int = 50257, ctx: int = 1024) -> int:
    """Parameters of a GPT-2 (tied embeddings): 12·d² + 13·d per block, embeddings, final norm."""
    return vocab * n_embd + ctx * n_embd + n_layer * (12 * n_embd ** 2 + 13 * n_embd) + 2 * n_embd


MODELS = {
    "lab MLP": 7_312,                            # labkit.sharding.model.DIMS, measured in §1
    "GPT-2 small": gpt2_params(12, 768),         # 124,439,808
    "GPT-2 XL": gpt2_params(48, 1600),           # 1,557,611,200
    "70B": 70_000_000_000,
}


def _check(setup: str, ranks: int, precision: str) -> dict:
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}.")
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks!r}.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}.")
    return PRECISIONS[precision]


def memory_per_rank(psi: int, ranks: int, setup: str, precision: str = "fp32",
                    buckets: bool = True) -> dict[str, float]:
    """Model-state bytes one rank holds: ``params``, ``grads``, ``optimizer``, ``buckets``, ``total``.

    ``buckets``: DDP's flat gradient buckets (a second copy of the gradients unless
    ``gradient_as_bucket_view=True``); also under ``ZeroRedundancyOptimizer``, which runs in DDP.
    """
    b = _check(setup, ranks, precision)
    n = ranks
    shard = {"DDP": (1, 1, 1), "ZeroRedundancyOptimizer": (1, 1, n), "ZeRO-1": (1, 1, n),
             "ZeRO-2": (1, n, n), "ZeRO-3": (n, n, n)}[setup]
    out = {"params": b["params"] * psi / shard[0], "grads": b["grads"] * psi / shard[1],
           "optimizer": b["optimizer"] * psi / shard[2],
           "buckets": b["grads"] * psi if buckets and setup in ("DDP", "ZeroRedundancyOptimizer")
           else 0.0}
    out["total"] = sum(out.values())
    return out


def traffic_per_step(psi: int, ranks: int, setup: str, precision: str = "fp32") -> dict:
    """Bytes one rank communicates per training step: ``volume`` (ZeRO's units) and ``ring_sent``."""
    b = _check(setup, ranks, precision)
    gathered, reduced = _SENT[setup]
    volume = psi * (gathered * b["gather"] + reduced * b["reduce"])
    return {"volume": float(volume), "ring_sent": volume * (ranks - 1) / ranks,
            "multiple_of_psi": gathered + reduced}


def plan(psi: int, ranks: int, gpu_gib: float = 80.0, precision: str = "mixed") -> list[dict]:
    """Every ZeRO setup for one model: GiB per rank, GB per step in ZeRO's units, and whether it
    fits.

    "Fits" compares model state (with DDP's buckets) with ``gpu_gib``: activations come on top,
    so a setup that fits here can still run out of memory (a prediction, not a measurement).
    """
    rows = []
    for setup in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        mem = memory_per_rank(psi, ranks, setup, precision)
        traffic = traffic_per_step(psi, ranks, setup, precision)
        rows.append({"setup": setup, "psi": psi, "ranks": ranks, "gib_per_rank": mem["total"] / 2**30,
                     "gb_sent_per_step": traffic["volume"] / 1e9,
                     "fits": mem["total"] / 2**30 <= gpu_gib})
    return rows


def plan_table(models: dict[str, int] | None = None, ranks: tuple[int, ...] = (8, 64),
               gpu_gib: float = 80.0, precision: str = "mixed") -> str:
    """A text table of :func:`plan` for several models and rank counts (model state only)."""
    models = MODELS if models is None else models
    setups = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    label = {"mixed": "the ZeRO paper's mixed precision (fp16 + fp32 master)",
             "bf16 policy": "FSDP2's bf16 parameters, fp32 reduction"}.get(precision, precision)
    def cell(r: dict) -> str:
        return f"{_g(r['gib_per_rank'])}{' ' if r['fits'] else '*'}/ {_g(r['gb_sent_per_step'])}"
    rows = [{"model": name, "psi": psi, "ranks": n,
             **{s: cell(r) for s, r in zip(setups, plan(psi, n, gpu_gib, precision))}}
            for name, psi in models.items() for n in ranks]
    return table([Col("model", "model", "<12"), Col("Ψ", "psi", ">14,"),
                  Col("ranks", "ranks", ">5"), *(Col(s, s, ">20") for s in setups)], rows,
                 above=[f"PREDICTION from the ZeRO formulas ({label} + Adam; model state and "
                        f"DDP's buckets, no activations; {gpu_gib:g} GiB GPUs). Cell: GiB per "
                        f"rank / GB per rank per step in ZeRO's units (elements x bytes; a ring "
                        f"link carries (N-1)/N of it); * = does not fit"])


def _g(x: float) -> str:
    return f"{x:.3g}" if x >= 0.01 else f"{x:.1e}"


def compare(measured: list[dict], precision: str = "fp32") -> list[dict]:
    """Prediction next to measurement, for the setups the lab ran.

    ``measured`` rows: ``setup`` (one of :data:`SETUPS`), ``world_size``, ``psi``, ``memory``
    (total bytes measured) and ``ring_sent`` (bytes counted in one step). Adds
    ``predicted_memory``, ``predicted_sent`` and the two ratios measured / predicted.
    """
    rows = []
    for m in measured:
        mem = memory_per_rank(m["psi"], m["world_size"], m["setup"], precision,
                              buckets=m.get("buckets", True))
        traffic = traffic_per_step(m["psi"], m["world_size"], m["setup"], precision)
        rows.append({**m, "predicted_memory": mem["total"], "predicted_sent": traffic["ring_sent"],
                     "memory_ratio": m["memory"] / mem["total"],
                     "sent_ratio": m["ring_sent"] / traffic["ring_sent"]})
    return rows
