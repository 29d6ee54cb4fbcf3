"""What a GPU cluster would show: a MODEL PREDICTION from the α–β model (notebook 07 §3, §4).

Nothing here is measured. Data-parallel step time on N GPUs, per GPU a fixed batch (weak
scaling, the usual way DDP jobs grow)::

    compute  = 6 · params · tokens_per_gpu / (peak_flops · mfu)     (Kaplan et al. 2020: ~6
                                                                     FLOPs per parameter and token)
    backward = 2/3 of compute
    allreduce = buckets · 2(N-1)·α + 2(N-1)/N · S / B               (a ring per DDP bucket:
                S = grad_bytes_per_param · params, buckets = 1 + ⌈(S − 1 MiB) / bucket⌉ (DDP's first
                bucket is 1 MiB), each paying the
                ring's 2(N-1) latency steps; labkit.collectives.bandwidth)
    exposed  = allreduce - overlap · backward, at least 0           (overlap in 0..1)
    step     = compute + exposed;   efficiency = compute / step

Link speeds are :func:`labkit.collectives.bandwidth.cluster_link` (published: NVLink inside a
node up to 8 GPUs; beyond, the ring's channels cross nodes through all 8 InfiniBand NICs of a
node at once, so a GPU's share moves at min(NVLink, 8 NICs) = 400 GB/s); the GPU's peak and the
MFU are assumptions (stated in every table). It ignores everything else that makes real jobs
slower — stragglers, the data loader, the optimizer step, a last bucket that cannot overlap — which is the point of
notebook 07's interview question.

Example::

    rows = lk.scaling.cluster_prediction(params=124e6, tokens_per_gpu=8192)
    print(lk.scaling.cluster_table(rows))
"""
from __future__ import annotations

import math
from typing import Iterable

from ..collectives.bandwidth import cluster_link, predict
from ..common.tables import Col, table

__all__ = ["GPU", "cluster_prediction", "cluster_table"]

# Assumed accelerator: NVIDIA H100 SXM, dense bf16 tensor-core peak (NVIDIA H100 datasheet).
GPU = {"name": "H100 SXM", "peak_flops": 989e12, "mfu": 0.4,
       "source": "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16; MFU 40% assumed"}


def cluster_prediction(params: float, tokens_per_gpu: int, gpus: Iterable[int] = (1, 8, 64, 256),
                       grad_bytes_per_param: int = 4, overlap: float = 1.0,
                       peak_flops: float = GPU["peak_flops"], mfu: float = GPU["mfu"],
                       bucket_mib: float = 25.0) -> list[dict]:
    """MODEL PREDICTION of step time and scaling efficiency per GPU count (see module docstring).

    ``overlap``: 1.0 = the all-reduce hides behind backward as far as backward lasts (the
    best case DDP aims for), 0.0 = no overlap at all. ``bucket_mib``: DDP's bucket size
    (25 MiB by default, after a first bucket of 1 MiB); every bucket is its own ring all-reduce
    and pays the ring's latency.
    """
    compute = 6 * params * tokens_per_gpu / (peak_flops * mfu)
    grad_bytes = grad_bytes_per_param * params
    # torch 2.13's DDP rebuilds its buckets after the first step with a first bucket of
    # dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) when bucket_cap_mb is left at its default,
    # of bucket_cap_mb otherwise (BucketCapacityConfig in torch/nn/parallel/distributed.py)
    cap = bucket_mib * 2 ** 20
    first = 2 ** 20 if bucket_mib == 25.0 else cap
    buckets = 1 + math.ceil(max(0.0, grad_bytes - first) / cap)
    out = []
    for n in gpus:
        if n == 1:
            ar, link = 0.0, "none"
        else:
            spec = cluster_link(n)
            ar = (buckets * predict(spec["alpha"], 0.0, 0, n)       # latency, once per bucket
                  + predict(0.0, 1 / spec["bandwidth"], grad_bytes, n))
            link = spec["name"]
        exposed = max(0.0, ar - overlap * compute * 2 / 3)
        step = compute + exposed
        out.append(dict(gpus=n, compute_s=compute, allreduce_s=ar, exposed_s=exposed,
                        step_s=step, efficiency=compute / step, speedup=n * compute / step,
                        link=link, buckets=buckets))
    return out


def cluster_table(rows: list[dict], title: str = "") -> str:
    buckets = max((r.get("buckets", 0) for r in rows), default=0)
    return table([Col("GPUs", "gpus", ">5"),
                  Col("compute ms", lambda r: r["compute_s"] * 1e3, ">11.2f"),
                  Col("all-reduce ms", lambda r: r["allreduce_s"] * 1e3, ">14.2f"),
                  Col("exposed ms", lambda r: r["exposed_s"] * 1e3, ">11.2f"),
                  Col("step ms", lambda r: r["step_s"] * 1e3, ">8.2f"),
                  Col("speedup", "speedup", ">8.1f"), Col("efficiency", "efficiency", ">11.2f"),
                  Col("link", "link")], rows,
                 above=[f"MODEL PREDICTION (alpha-beta model, published link speeds, a flat ring "
                        f"per DDP bucket, {buckets} buckets per step, {GPU['source']}); not "
                        f"measured" + (f": {title}" if title else "")])
