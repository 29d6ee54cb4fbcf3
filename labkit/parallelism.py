"""Data parallelism vs model parallelism, measured: the experiments of notebook 01.

* :func:`replica_drift` — 4 ranks train their own copy on their own data.
  Without communication the copies drift apart (4 different models); with
  gradients averaged by ``all_reduce`` they stay identical (checksum spread 0).
* :func:`pipeline` — one model split across 2 ranks: activations go forward
  with ``send``/``recv``, gradients come back the same way. Each rank records a
  timeline, so the idle time (the pipeline bubble) is measured, not drawn;
  micro-batches shrink it. The split model's gradients are checked against the
  same model run whole in one process.
* :func:`memory_table` — bytes per rank for each strategy from real parameter
  counts (:func:`gpt_like` builds a GPT-2-shaped model on the ``meta`` device,
  so even 1.5 billion parameters cost no memory to count).

Example::

    drift = lk.parallelism.replica_drift(data_parallel=False)
    pipe = lk.parallelism.pipeline(micro_batches=4)
    lk.plots.timeline(pipe["spans"])
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["replica_drift", "pipeline", "mlp", "gpt_like", "split_layers", "memory_table",
           "BYTES_PER_PARAM", "DDP_BUCKET_BYTES", "idle_of_rank1"]


def mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear+Tanh blocks of ``width`` units (deterministic from ``seed``)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


# ------------------------------------------------------------ replica drift
def _drift_rank(rank: int, world_size: int, steps: int, data_parallel: bool, lr: float,
                seed: int) -> dict:
    from .ddp import average_gradients, checksum, device

    dev = device()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev)
    torch.manual_seed(seed)                     # the same start on every rank ...
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(seed + 1000 + rank)   # ... but each rank its own data
    w_true = torch.linspace(-1, 1, 8)
    checksums, distances, losses = [], [], []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.3 * torch.randn(16, 1, generator=g)
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        model.zero_grad()
        loss.backward()
        if data_parallel:
            average_gradients(model)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=lr)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)         # measuring only: compare every pair of replicas
        distances.append(max(float((a - b).norm()) for a in everyone for b in everyone))
        checksums.append(checksum(model))
        losses.append(float(loss))
    return {"checksums": checksums, "distance": distances, "losses": losses}


def replica_drift(world_size: int = 4, steps: int = 30, data_parallel: bool = False,
                  lr: float = 0.05, seed: int = 0) -> dict:
    """Train one small model per rank, each on its own data, with or without gradient averaging.

    Returns ``{"checksums": [rank][step], "distance": [step], "spread": [step],
    "losses": [rank][step], "data_parallel": bool}``: ``distance`` is the largest
    L2 distance between two replicas' parameters, ``spread`` the largest
    difference of two ranks' checksums (exactly 0.0 when they are identical).

    Example::

        apart = replica_drift(data_parallel=False)["spread"][-1]   # > 0
        same = replica_drift(data_parallel=True)["spread"][-1]     # 0.0
    """
    import labkit as lk

    res = lk.run(_drift_rank, world_size, args=(steps, data_parallel, lr, seed), echo=False)
    sums = [v["checksums"] for v in res.values]
    spread = [max(col) - min(col) for col in zip(*sums)]
    return {"checksums": sums, "distance": res.values[0]["distance"], "spread": spread,
            "losses": [v["losses"] for v in res.values], "data_parallel": data_parallel}


# ------------------------------------------------------ model parallelism
def _pipeline_rank(rank: int, world_size: int, width: int, depth: int, batch: int,
                   micro_batches: int, steps: int, seed: int) -> dict:
    from .ddp import device
    from .timeline import Timeline

    if world_size != 2:
        raise ValueError(f"this pipeline has 2 stages, so it needs world_size=2, got {world_size}.")
    dev = device()
    whole = mlp(width, 2 * depth, seed)         # build it whole, keep only this rank's half
    stage = whole[:depth] if rank == 0 else whole[depth:]
    stage.to(dev)
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=data).to(dev)
    target = torch.randn(batch, width, generator=data).to(dev)
    chunks = list(zip(x.chunk(micro_batches), target.chunk(micro_batches)))
    per_step = []
    for _ in range(steps):                      # the notebook shows the least disturbed step
        dist.barrier()                          # both stages start the step together
        tl = Timeline(rank, cuda_sync=dev.type == "cuda")
        stage.zero_grad()
        outs, sends, mb = [], [], len(chunks)
        for i, (xb, tb) in enumerate(chunks):   # all forwards (GPipe: fill ...)
            if rank == 0:
                with tl.span("forward", label=f"F{i}"):
                    h = stage(xb)
                sends.append(dist.isend(h.detach(), dst=1))
                outs.append(h)
            else:
                h_in = torch.empty(xb.shape[0], width, device=dev)
                with tl.span("idle", label="wait"):
                    dist.recv(h_in, src=0)
                h_in.requires_grad_(True)
                with tl.span("forward", label=f"F{i}"):
                    loss = F.mse_loss(stage(h_in), tb) / mb
                outs.append((h_in, loss))
        for i in range(mb):                     # ... then all backwards (... and drain)
            if rank == 1:
                h_in, loss = outs[i]
                with tl.span("backward", label=f"B{i}"):
                    loss.backward()
                sends.append(dist.isend(h_in.grad, dst=0))
            else:
                grad = torch.empty_like(outs[i])
                with tl.span("idle", label="wait"):
                    dist.recv(grad, src=1)
                with tl.span("backward", label=f"B{i}"):
                    outs[i].backward(grad)
        for s in sends:
            s.wait()
        per_step.append(tl.spans)
    # slicing a Sequential keeps the original names ("3.0.weight"), so names match `whole`
    grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
    return {"steps": per_step, "grads": grads, "params": sum(p.numel() for p in stage.parameters())}


def pipeline(micro_batches: int = 1, width: int = 512, depth: int = 4, batch: int = 512,
             steps: int = 4, seed: int = 0) -> dict:
    """Run a ``2*depth``-layer MLP split across 2 ranks (model parallelism) and measure it.

    Rank 0 holds the first ``depth`` layers, rank 1 the rest and the loss. The
    batch is cut into ``micro_batches`` (GPipe schedule: all forwards, then all
    backwards). Of ``steps`` identical steps, the one that took least time (the
    least disturbed by other programs on the machine) is reported, and the
    gradients are from the last step.

    Returns ``{"spans": [rank][span], "idle": [fraction per rank], "params":
    [count per rank], "max_grad_diff": float, "micro_batches": int}`` where
    ``max_grad_diff`` compares the split model's gradients with the whole model
    run in one process (the oracle).

    Example::

        one = pipeline(micro_batches=1)["idle"]    # each rank idle about half the time
        four = pipeline(micro_batches=4)["idle"]   # less: the bubble shrinks
    """
    import labkit as lk

    from .timeline import align, busy_seconds, fastest_step

    res = lk.run(_pipeline_rank, 2, args=(width, depth, batch, micro_batches, steps, seed),
                 echo=False)
    spans = align(fastest_step([v["steps"] for v in res.values]))
    lo = min(s["start"] for r in spans for s in r)
    hi = max(s["end"] for r in spans for s in r)
    whole = mlp(width, 2 * depth, seed)         # the oracle: one process, whole batch
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=data)
    target = torch.randn(batch, width, generator=data)
    F.mse_loss(whole(x), target).backward()
    diff = 0.0
    for v in res.values:
        for name, g in v["grads"].items():
            diff = max(diff, float((g - whole.get_parameter(name).grad).abs().max()))
    # idle = not computing: waiting in recv, or anything else that is not forward/backward
    idle = [1.0 - busy_seconds(s, ("forward", "backward")) / (hi - lo) for s in spans]
    return {"spans": spans, "idle": idle,
            "params": [v["params"] for v in res.values], "max_grad_diff": diff,
            "micro_batches": micro_batches}


# ------------------------------------------------------------ memory per rank
BYTES_PER_PARAM = {"weights": 4, "grads": 4, "adam": 8}   # fp32 weights, grads, Adam m and v
# torch DDP keeps a flat bucket copy of every fp32 gradient (its default
# gradient_as_bucket_view=False): tests/test_claims_ddp.py measures it from tensor storages
DDP_BUCKET_BYTES = 4


class _Block(nn.Module):
    """One GPT-2 block: LayerNorm, attention (qkv + output projection), LayerNorm, 4x MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


def gpt_like(n_layer: int = 12, d_model: int = 768, vocab: int = 50257,
             context: int = 1024) -> nn.Module:
    """A GPT-2-shaped decoder (GPT-2 small by default) on the ``meta`` device: shapes, no memory.

    The output layer is tied to the token embedding, as in GPT-2. ``n_layer=48,
    d_model=1600`` is GPT-2 XL's shape (1,557,611,200 parameters).
    """
    with torch.device("meta"):
        # embeddings get their (meta) weight directly: a random init on meta would import
        # torch._dynamo, which costs seconds
        return nn.ModuleDict({
            "wte": nn.Embedding(vocab, d_model, _weight=torch.empty(vocab, d_model)),
            "wpe": nn.Embedding(context, d_model, _weight=torch.empty(context, d_model)),
            "blocks": nn.ModuleList(_Block(d_model) for _ in range(n_layer)),
            "ln_f": nn.LayerNorm(d_model)})


def split_layers(counts: list[int], stages: int) -> list[int]:
    """Parameters per stage when consecutive layers (``counts`` each) go to ``stages`` ranks.

    Greedy contiguous split aiming at equal shares, as a pipeline would place them.

    >>> split_layers([10, 10, 10, 10], 2)
    [20, 20]
    """
    total = sum(counts)
    out, before = [0] * stages, 0
    for c in counts:         # a layer goes to the stage its middle falls in
        k = min(stages - 1, int((before + c / 2) * stages / total)) if total else 0
        out[k] += c
        before += c
    return out


def memory_table(model: nn.Module, world_size: int,
                 ddp_bytes_per_param: float | None = None) -> list[dict]:
    """Model state per rank (fp32 weights + grads + Adam) for each strategy, from real counts.

    Model parallelism splits the model's top-level layers across ranks
    (:func:`split_layers`); the busiest rank is reported. Under torch DDP a parameter
    costs ``ddp_bytes_per_param`` (default 16 + :data:`DDP_BUCKET_BYTES` = 20: DDP's
    gradient buckets are a second copy of the gradients; notebook 01 passes the value it
    measured). Activations are not counted: they depend on batch size and grow for data
    parallelism too. Rows: ``strategy, params, bytes_per_param, GB, note``.
    """
    per_param = sum(BYTES_PER_PARAM.values())
    ddp = per_param + DDP_BUCKET_BYTES if ddp_bytes_per_param is None else ddp_bytes_per_param
    total = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in m.parameters()) for m in _top_layers(model)]
    busiest = max(split_layers(layers, world_size))
    rows = [("1 GPU", total, per_param, "everything on one device"),
            ("data parallel (DDP)", total, ddp, "a full replica + DDP's bucket copy of the grads"),
            ("model parallel (pipeline)", busiest, per_param,
             "each rank holds its layers (busiest rank)"),
            ("FSDP / ZeRO-3", -(-total // world_size), per_param,
             "params, grads and Adam state sharded")]
    return [{"strategy": name, "params": n, "bytes_per_param": b, "GB": n * b / 1e9, "note": note}
            for name, n, b, note in rows]


def _top_layers(model: nn.Module) -> list[nn.Module]:
    out = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out.extend(_top_layers(child))
        else:
            out.append(child)
    return out or [model]


# ------------------------------------------------------------ quiz keys
def idle_of_rank1(pipe1: dict) -> float:
    """Quiz key (01.measured_idle): rank 1's idle fraction in the learner's 1-micro-batch run."""
    if not isinstance(pipe1, dict) or "idle" not in pipe1:
        raise ValueError("pipe1 must be the result of lk.parallelism.pipeline(micro_batches=1): "
                         "run that cell first.")
    return round(float(pipe1["idle"][1]), 3)
