"""Sequence parallelism with tensor parallelism (notebook 09, "Sequence parallelism").

Tensor parallelism (notebook 06) splits a block's matrix multiplications over N ranks and
leaves the rest whole on every rank: both LayerNorms, both residual dropouts, and the inputs of
the two column-parallel linears, which every rank keeps in full for its backward. Korthikanti et
al. (2022, §4.2.2) split those regions along the **sequence** instead: rank r holds tokens
``[r·s/N, (r+1)·s/N)`` there. The transitions change:

* **into** the tensor-parallel region: tensor parallelism's identity (notebook 06's *f*, whose
  backward all-reduces) becomes an **all-gather along the sequence** (backward: a
  reduce-scatter);
* **out of** it: tensor parallelism's all-reduce of the partial sums (06's *g*) becomes a
  **reduce-scatter along the sequence** (backward: an all-gather). Each rank keeps the summed
  rows of its own tokens, which is all its LayerNorm and dropout need.

A ring all-reduce *is* a reduce-scatter followed by an all-gather (notebooks 03 and 06), so the
bytes stay those of tensor parallelism; the activation memory of the split regions divides by N.
Megatron-LM goes one step further (``LinearWithGradAccumulationAndAsyncCommunication`` in
``megatron/core/tensor_parallel/layers.py``): a column-parallel linear keeps only its 1/N shard
of the gathered input and all-gathers it again in backward, one more all-gather per linear for
the last whole tensor (``regather=True`` here).

:class:`ParallelBlock` is :class:`~labkit.sequences_experts.activations.Block` on N ranks with
``mode="tp"`` or ``mode="tp+sp"``; its collectives are the lab's ring halves
(``comm="ring"``: :func:`labkit.sharding.ring_reduce_scatter` and
:func:`~labkit.sharding.ring_all_gather`, tensor parallelism's all-reduce being the two in a
row) or torch's (``comm="torch"``: ``all_gather_single``, ``reduce_scatter_single``,
``all_reduce``). With the ring, the bytes a rank writes to its sockets are the algorithm's: on
gloo, torch 2.13 runs ``reduce_scatter_single`` as a whole all-reduce (notebook 06 §9), which
would hide the point on the wire.

The replicated parameters (both LayerNorms, the row-parallel biases) see only their rank's
tokens under sequence parallelism, so their gradients are partial sums: :func:`sync_replicated`
all-reduces them once per step (6h numbers, whatever s and b).

:func:`compare` (in every rank) checks TP and TP+SP against one process and measures activation
bytes, bytes sent and step time; :func:`bench_rows` runs it for ``python -m labkit bench
sequences``.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..sharding.counting import CommCounter
from ..sharding.ring import ring_all_gather, ring_reduce_scatter
from .activations import Block, SavedTensors, _input, block_formula, make_block

__all__ = ["ParallelBlock", "check_shapes", "shard_sequence", "sync_replicated",
           "activation_formula", "sent_formula", "compare", "bench_rows", "table", "plot_regions",
           "MODES", "COMMS", "SETUPS", "FRAMING_BYTES"]

MODES = ("tp", "tp+sp")
COMMS = ("ring", "torch")
FRAMING_BYTES = 144   # gloo's bytes per isend/irecv pair on top of the payload (torch 2.13;
#                       labkit/grading/watch.py, tests/collectives/test_watch.py)


# ----------------------------------------------------------------------------- shapes
def check_shapes(s: int | None, n: int, n_head: int, n_embd: int) -> None:
    """Refuse a split over ``n`` ranks that does not divide, naming the parameter (ValueError).
    ``s=None``: the heads only (a block is built before it sees a sequence)."""
    if n_head % n:
        raise ValueError(f"n_head={n_head} heads do not split over {n} ranks: tensor parallelism "
                         f"gives each rank n_head/N whole heads; choose n_head divisible by {n}.")
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}.")
    if s is not None and s % n:
        raise ValueError(f"sequence length s={s} does not split over {n} ranks: sequence "
                         f"parallelism gives each rank s/N tokens; choose s divisible by {n}.")


def shard_sequence(x: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of a whole ``[s, b, h]`` tensor: rows ``[r·s/N, (r+1)·s/N)``
    (refuses an s that N does not divide, naming it)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    s = x.shape[0]
    if s % n:
        raise ValueError(f"sequence length s={s} does not split over {n} ranks: sequence "
                         f"parallelism gives each rank s/N tokens; choose s divisible by {n}.")
    k = s // n
    return x[rank * k:(rank + 1) * k]


# ----------------------------------------------------------------------------- collectives
def _all_gather(x: torch.Tensor, comm: str) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 in rank order (the sequence)."""
    n = dist.get_world_size()
    x = x.contiguous()
    if comm == "ring":
        return ring_all_gather(x.view(-1)).view(n * x.shape[0], *x.shape[1:])
    out = x.new_empty(n * x.shape[0], *x.shape[1:])
    dist.all_gather_single(out, x)
    return out


def _reduce_scatter(x: torch.Tensor, comm: str) -> torch.Tensor:
    """The sum over ranks of ``x``, this rank's 1/N of dim 0 (its tokens)."""
    n = dist.get_world_size()
    x = x.contiguous()
    if comm == "ring":
        return ring_reduce_scatter(x.view(-1)).view(x.shape[0] // n, *x.shape[1:])
    out = x.new_empty(x.shape[0] // n, *x.shape[1:])
    dist.reduce_scatter_single(out, x)
    return out


def _all_reduce(x: torch.Tensor, comm: str) -> torch.Tensor:
    """The sum over ranks (a new tensor). Ring: the two halves in a row."""
    x = x.contiguous()
    if comm == "ring":
        return ring_all_gather(ring_reduce_scatter(x.view(-1))).view_as(x)
    x = x.clone()
    dist.all_reduce(x)
    return x


class _EnterTP(torch.autograd.Function):        # notebook 06's f
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ExitTP(torch.autograd.Function):         # notebook 06's g
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _EnterSP(torch.autograd.Function):        # all-gather forward, reduce-scatter backward
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm), None


class _ExitSP(torch.autograd.Function):         # reduce-scatter forward, all-gather backward
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm), None


class _GatherLinear(torch.autograd.Function):
    """All-gather along the sequence, then a column-parallel linear, keeping only the shard:
    backward all-gathers it again for the weight's gradient (Megatron-LM's way)."""

    @staticmethod
    def forward(ctx, shard, weight, bias, comm):
        ctx.comm = comm
        ctx.save_for_backward(shard, weight)
        return F.linear(_all_gather(shard, comm), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        whole = _all_gather(shard, ctx.comm)                  # again: it was not kept
        grad_whole = grad @ weight
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ whole.reshape(-1, whole.shape[-1])
        return (_reduce_scatter(grad_whole, ctx.comm), grad_weight, grad.sum(dim=(0, 1)), None)


# ----------------------------------------------------------------------------- the block
class ParallelBlock(Block):
    """``block`` on the ranks of the default group, tensor-parallel (``mode="tp"``) or tensor-
    and sequence-parallel (``mode="tp+sp"``).

    Rank 0's weights are broadcast first. Rank r keeps heads ``[r·a/N, (r+1)·a/N)`` of the
    query/key/value projection (column-parallel: their rows of q, k and v), the same columns of
    the output projection (row-parallel), rows ``[r·4h/N, (r+1)·4h/N)`` of ``fc`` and those
    columns of ``fc2``; LayerNorms and the row-parallel biases whole. Input and output: the
    whole ``[s, b, h]`` under ``"tp"``; this rank's ``[s/N, b, h]`` tokens under ``"tp+sp"``.
    ``regather`` (tp+sp only): keep the column-parallel linears' input as the shard, all-gather
    it again in backward. Dropout masks come from global positions
    (:func:`~labkit.sequences_experts.activations.keep_mask`): every layout drops the same
    elements.
    """

    def __init__(self, block: Block, mode: str = "tp+sp", comm: str = "ring",
                 regather: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}.")
        if comm not in COMMS:
            raise ValueError(f"comm={comm!r}: choose one of {', '.join(COMMS)}.")
        if regather and mode != "tp+sp":
            raise ValueError("regather=True keeps a sequence shard: it needs mode='tp+sp'.")
        if block.dropout_kind == "torch" and block.p > 0:
            raise ValueError("dropout='torch' draws masks from each process's random generator, "
                             "so ranks would not drop what one process drops: use "
                             "dropout='hashed' (or p=0).")
        if block.recompute != "none":
            raise ValueError("recompute is measured on one process; build the block with "
                             "recompute='none'.")
        cfg = block.cfg
        n, rank = dist.get_world_size(), dist.get_rank()
        check_shapes(None, n, cfg.n_head, cfg.n_embd)         # the heads; s: shard_sequence
        with torch.random.fork_rng(devices=[]):              # its own init is overwritten
            super().__init__(cfg, attention=block.attention, dropout=block.dropout_kind,
                             seed=block.seed)
        self.load_state_dict(block.state_dict())
        with torch.no_grad():
            for p in self.parameters():
                dist.broadcast(p, src=0)
        self.train(block.training)
        self.mode, self.comm, self.regather, self.n, self.rank = mode, comm, regather, n, rank
        h = cfg.n_embd
        hl = h // n                                         # this rank's heads x head_dim
        self.heads_here, self.head_offset = cfg.n_head // n, rank * (cfg.n_head // n)
        mine = slice(rank * hl, (rank + 1) * hl)
        qkv_rows = torch.cat([torch.arange(mine.start, mine.stop) + j * h for j in range(3)])
        fc_rows = slice(rank * 4 * h // n, (rank + 1) * 4 * h // n)
        self.attn.qkv = self._linear(self.attn.qkv, rows=qkv_rows)
        self.attn.proj = self._linear(self.attn.proj, cols=mine)
        self.mlp.fc = self._linear(self.mlp.fc, rows=fc_rows)
        self.mlp.proj = self._linear(self.mlp.proj, cols=fc_rows)

    @staticmethod
    def _linear(full: nn.Linear, rows=None, cols=None) -> nn.Linear:
        w = full.weight.detach()
        w = w[rows] if rows is not None else w[:, cols]
        part = nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            part.weight.copy_(w)
            part.bias.copy_(full.bias.detach()[rows] if rows is not None else full.bias.detach())
        return part

    # the layout hooks of Block
    def _column(self, x, linear):
        if self.mode == "tp":
            return F.linear(_EnterTP.apply(x, self.comm), linear.weight, linear.bias)
        if self.regather:
            return _GatherLinear.apply(x, linear.weight, linear.bias, self.comm)
        return F.linear(_EnterSP.apply(x, self.comm), linear.weight, linear.bias)

    def _row(self, x, linear):
        partial = F.linear(x, linear.weight)
        exit_ = _ExitTP if self.mode == "tp" else _ExitSP
        return exit_.apply(partial, self.comm) + linear.bias

    def _sequence(self, local):
        if self.mode == "tp":
            return 0, local
        return self.rank * local, self.n * local

    def replicated(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole: LayerNorms, row-parallel biases."""
        return [*self.ln1.parameters(), *self.ln2.parameters(), self.attn.proj.bias,
                self.mlp.proj.bias]


def sync_replicated(block: ParallelBlock) -> None:
    """(tp+sp) All-reduce the replicated parameters' gradients: each rank's are sums over its
    own tokens only. One all-reduce of 6h numbers per step, whatever s and b."""
    params = block.replicated()
    flat = _all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), block.comm)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


# ----------------------------------------------------------------------------- formulas
def activation_formula(mode: str, s: int, b: int, h: int, a: int, n: int,
                       regather: bool = False, attention: str = "materialised") -> float:
    """Bytes one rank keeps for backward (fp32, 1-byte masks, LayerNorm statistics included):
    :func:`~labkit.sequences_experts.activations.block_formula` for the layout."""
    layout = {"one process": "one process", "tp": "tp",
              "tp+sp": "tp+sp regather" if regather else "tp+sp"}[mode]
    terms = block_formula(s, b, h, a, n if mode != "one process" else 1, layout)
    if attention == "sdpa":
        raise ValueError("activation_formula counts materialised attention only.")
    return sum(terms.values())


def sent_formula(mode: str, s: int, b: int, h: int, n: int, regather: bool = False,
                 framing: int = FRAMING_BYTES) -> dict:
    """Bytes one rank sends in one forward + backward of a block on the ring (``comm="ring"``).

    ``S = 4·s·b·h`` (the activation, fp32); each ring half (reduce-scatter or all-gather) sends
    ``(N-1)/N·S`` in N-1 messages of ``framing`` bytes more each. Tensor parallelism: 2
    all-reduces forward, 2 backward, 8 halves; with sequence parallelism: 2 all-gathers and 2
    reduce-scatters each way, 8 halves; ``regather``: 2 all-gathers more in backward, 10.
    Returns ``halves``, ``payload`` and ``wire`` (payload + framing).
    """
    halves = 10 if (mode == "tp+sp" and regather) else 8
    S = 4 * s * b * h
    payload = halves * (n - 1) * S // n
    return {"halves": halves, "payload": payload,
            "wire": payload + halves * (n - 1) * framing}


# ----------------------------------------------------------------------------- the job
def _max_diff(pairs) -> float:
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def _oracle_grads(oracle: Block, block: ParallelBlock) -> list[tuple]:
    """(parallel gradient, the matching piece of one process's) for every parameter."""
    n, rank, h = block.n, block.rank, block.cfg.n_embd
    hl = h // n
    mine = slice(rank * hl, (rank + 1) * hl)
    qkv_rows = torch.cat([torch.arange(mine.start, mine.stop) + j * h for j in range(3)])
    fc = slice(rank * 4 * h // n, (rank + 1) * 4 * h // n)
    o, p = oracle, block
    return [(p.ln1.weight.grad, o.ln1.weight.grad), (p.ln1.bias.grad, o.ln1.bias.grad),
            (p.ln2.weight.grad, o.ln2.weight.grad), (p.ln2.bias.grad, o.ln2.bias.grad),
            (p.attn.qkv.weight.grad, o.attn.qkv.weight.grad[qkv_rows]),
            (p.attn.qkv.bias.grad, o.attn.qkv.bias.grad[qkv_rows]),
            (p.attn.proj.weight.grad, o.attn.proj.weight.grad[:, mine]),
            (p.attn.proj.bias.grad, o.attn.proj.bias.grad),
            (p.mlp.fc.weight.grad, o.mlp.fc.weight.grad[fc]),
            (p.mlp.fc.bias.grad, o.mlp.fc.bias.grad[fc]),
            (p.mlp.proj.weight.grad, o.mlp.proj.weight.grad[:, fc]),
            (p.mlp.proj.bias.grad, o.mlp.proj.bias.grad)]


SETUPS = (("TP", "tp", False), ("TP+SP", "tp+sp", False), ("TP+SP regather", "tp+sp", True))


def compare(rank: int, world_size: int, s: int = 16, b: int = 2, h: int = 32, a: int = 4,
            p: float = 0.1, comm: str = "ring", setups=SETUPS, rounds: int = 0,
            attention: str = "materialised") -> list[dict]:
    """(In every rank.) Each setup of ``setups`` (name, mode, regather) against one process.

    Every rank builds its block from its own seed (rank 0's weights are broadcast), runs one
    forward and backward of ``loss = <output, w>`` (``w`` fixed: every gradient differs) and
    compares output, input gradient and parameter gradients with one process running the whole
    sequence (the matching slice of each). Measured per setup: ``activation_bytes`` (what
    autograd keeps in this rank, :class:`~labkit.sequences_experts.activations.SavedTensors`),
    ``sent`` (bytes this rank wrote to its sockets, gloo's framing included:
    :class:`labkit.grading.watch.Watch`), ``kinds`` (the collectives it issued, with payloads:
    :class:`labkit.sharding.CommCounter`), ``sync_sent`` (tp+sp: :func:`sync_replicated`) and,
    when ``rounds`` > 0, ``step_ms`` (median over rounds of one forward + backward, the setups
    in turn, each round started by a barrier). Formulas beside: ``activation_formula``,
    ``sent_formula``.
    """
    from ..grading.watch import Watch
    check_shapes(s, world_size, a, h)
    oracle = make_block(h, a, p, attention=attention, seed=0)
    x = _input(s, b, h)
    w = _input(s, b, h, seed=2)
    xo = x.clone().requires_grad_()
    with SavedTensors(exclude=list(oracle.parameters())) as saved:
        y_one = oracle(xo)
    oracle_bytes = saved.total
    (y_one * w).sum().backward()
    k = s // world_size
    mine = slice(rank * k, (rank + 1) * k)        # shard_sequence(x) is x[mine]
    watch = Watch()
    rows, blocks = [], {}
    for name, mode, regather in setups:
        base = make_block(h, a, p, attention=attention, seed=0)
        if rank:                                      # other ranks start from other weights,
            g = torch.Generator().manual_seed(100 + rank)   # which the broadcast must replace
            with torch.no_grad():
                for q in base.parameters():
                    q.add_(torch.randn(q.shape, generator=g))
        block = ParallelBlock(base, mode, comm, regather)
        blocks[name] = block
        sp = mode == "tp+sp"
        xi = (shard_sequence(x) if sp else x).clone().requires_grad_()
        wi = shard_sequence(w) if sp else w
        with SavedTensors(exclude=list(block.parameters())) as saved:
            with CommCounter() as fwd_comm:
                watch.start()
                y = block(xi)
                fwd_sent = watch.stop()
        with CommCounter() as bwd_comm:
            watch.start()
            (y * wi).sum().backward()
            bwd_sent = watch.stop()
        sync = {}
        if sp:
            watch.start()
            sync_replicated(block)
            sync = watch.stop()
        ref_y, ref_x = (y_one[mine], xo.grad[mine]) if sp else (y_one, xo.grad)
        rows.append({
            "setup": name, "mode": mode, "regather": regather, "comm": comm,
            "world_size": world_size, "shape": {"s": s, "b": b, "h": h, "a": a},
            "out_diff": _max_diff([(y, ref_y)]), "x_grad_diff": _max_diff([(xi.grad, ref_x)]),
            "grad_diff": _max_diff(_oracle_grads(oracle, block)),
            "activation_bytes": saved.total, "by_tag": saved.by_tag(),
            "activation_formula": (activation_formula(mode, s, b, h, a, world_size, regather)
                                   if attention == "materialised" else None),
            "sent": fwd_sent["sent"] + bwd_sent["sent"],
            "sent_forward": fwd_sent["sent"], "sent_backward": bwd_sent["sent"],
            "gloo_collectives": fwd_sent["collectives"] + bwd_sent["collectives"],
            "sent_formula": sent_formula(mode, s, b, h, world_size, regather),
            "kinds": {"forward": _kinds(fwd_comm), "backward": _kinds(bwd_comm)},
            "ring_sent": fwd_comm.ring_sent() + bwd_comm.ring_sent(),
            "sync_sent": sync.get("sent", 0),
            "one_process_bytes": oracle_bytes,
        })
    if rounds:
        times = {name: [] for name in blocks}
        names = list(blocks)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                block = blocks[name]
                sp = block.mode == "tp+sp"
                xi = (x[mine] if sp else x).clone().requires_grad_()
                dist.barrier()
                t0 = time.perf_counter()
                (block(xi) * (w[mine] if sp else w)).sum().backward()
                if sp:
                    sync_replicated(block)
                times[name].append(1e3 * (time.perf_counter() - t0))
        for row in rows:
            row["step_ms"] = statistics.median(times[row["setup"]])
    return rows


def _kinds(comm: CommCounter) -> dict:
    out = {}
    for kind, t in comm.totals().items():
        out[kind] = {"calls": t["calls"], "bytes": t["bytes"]}
    return out


# ----------------------------------------------------------------------------- bench
def bench_rows(world_size: int = 2, s: int = 128, b: int = 4, h: int = 256, a: int = 8,
               rounds: int = 10, comm: str = "ring") -> list[dict]:
    """TP vs TP+SP (and TP+SP with Megatron's regather) on ``world_size`` ranks: one row each
    with activation bytes per rank (measured, formula), the bytes rank 0 sent in one forward +
    backward (measured on its sockets, formula), the replicated-gradient all-reduce, step time
    (median over ``rounds`` of the slowest rank), and the largest difference from one process."""
    from ..runtime import run
    per_rank = run(compare, world_size,
                   kwargs=dict(s=s, b=b, h=h, a=a, comm=comm, rounds=rounds),
                   timeout=120, deadline=600, echo=False).values
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        everyone = [v[i] for v in per_rank]
        rows.append({"world_size": world_size, "setup": r0["setup"], "comm": comm,
                     "shape": r0["shape"],
                     "activation_bytes": max(v["activation_bytes"] for v in everyone),
                     "activation_formula": r0["activation_formula"],
                     "sent": r0["sent"], "sent_formula": r0["sent_formula"]["wire"],
                     "sync_sent": r0["sync_sent"],
                     "step_ms": max(v["step_ms"] for v in everyone),
                     "max_diff": max(max(v["out_diff"], v["x_grad_diff"], v["grad_diff"])
                                     for v in everyone)})
    return rows


def table(rows: list[dict]) -> str:
    """A Markdown table of :func:`bench_rows`' rows."""
    out = ["| ranks | setup | activation KiB per rank (formula) | KiB sent per rank, fwd+bwd "
           "(formula) | + replicated grads | step ms | max\\|Δ\\| vs 1 process |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['world_size']} | {r['setup']} | {r['activation_bytes'] / 1024:.1f} "
                   f"({r['activation_formula'] / 1024:.1f}) | {r['sent'] / 1024:.1f} "
                   f"({r['sent_formula'] / 1024:.1f}) | {r['sync_sent'] / 1024:.1f} | "
                   f"{r['step_ms']:.1f} | {r['max_diff']:.1e} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- picture
def plot_regions(n: int = 2, ax=None):
    """Where each part of a block runs, tensor parallelism alone (top) and with sequence
    parallelism (bottom), and the collective at each transition. A drawing, not a measurement."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.8))
    parts = [("LayerNorm", "seq", ""), ("attention", "tp", f"1/{n} of the heads"),
             ("dropout,\nresidual add", "seq", ""), ("LayerNorm", "seq", ""),
             ("MLP", "tp", f"1/{n} of fc's rows"), ("dropout,\nresidual add", "seq", "")]
    colours = {"whole": "#d9d9d9", "tp": "#9ecae1", "seq": "#a1d99b"}
    width, gap = 1.6, 1.25
    for row, (label, sp) in enumerate((("tensor parallelism\nalone", False),
                                       ("tensor + sequence\nparallelism", True))):
        y0 = 2.3 - 2.3 * row
        ax.text(-0.2, y0 + 0.62, label, ha="right", va="center", fontsize=9)
        x = 0.0
        for i, (name, region, split) in enumerate(parts):
            kind = region if (region == "tp" or sp) else "whole"
            ax.add_patch(Rectangle((x, y0), width, 1.25, facecolor=colours[kind], edgecolor="k"))
            sub = {"whole": "whole on\nevery rank", "tp": split,
                   "seq": f"s/{n} tokens\nper rank"}[kind]
            ax.text(x + width / 2, y0 + 0.88, name, ha="center", va="center", fontsize=8.5)
            ax.text(x + width / 2, y0 + 0.3, sub, ha="center", va="center", fontsize=7)
            x += width
            if i < len(parts) - 1:
                into, outof = parts[i + 1][1] == "tp", region == "tp"
                if into:
                    txt = ("all-gather\n(backward:\nreduce-scatter)" if sp
                           else "f: identity\n(backward:\nall-reduce)")
                elif outof:
                    txt = ("reduce-scatter\n(backward:\nall-gather)" if sp
                           else "g: all-reduce\n(backward:\nidentity)")
                else:
                    txt = ""
                ax.annotate("", xy=(x + gap - 0.05, y0 + 0.62), xytext=(x + 0.05, y0 + 0.62),
                            arrowprops=dict(arrowstyle="->"))
                if txt:
                    ax.text(x + gap / 2, y0 - 0.08, txt, ha="center", va="top", fontsize=7,
                            color="C3")
                x += gap
    ax.set_xlim(-2.4, x + 0.1)
    ax.set_ylim(-1.0, 3.7)
    ax.axis("off")
    ax.set_title(f"one transformer block on {n} ranks: grey whole on every rank, blue split by "
                 f"tensor parallelism, green split along the sequence (a drawing)", fontsize=9)
    return ax
