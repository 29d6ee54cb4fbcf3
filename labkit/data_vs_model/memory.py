"""Memory per rank, from real parameter counts (notebook 01 §4).

:func:`memory_table` — bytes of model state per rank for each strategy; :func:`gpt_like` builds
a GPT-2-shaped model on the ``meta`` device, so even 1.5 billion parameters cost no memory to
count. Notebook 06 measures the same quantities from real tensors' storages.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["gpt_like", "split_layers", "memory_table", "BYTES_PER_PARAM", "DDP_BUCKET_BYTES"]


BYTES_PER_PARAM = {"weights": 4, "grads": 4, "adam": 8}   # fp32 weights, grads, Adam m and v
# torch DDP keeps a flat bucket copy of every fp32 gradient (its default
# gradient_as_bucket_view=False): tests/claims/test_claims_ddp.py measures it from tensor storages
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
