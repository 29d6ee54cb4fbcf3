"""Activation memory, measured (notebook 09, "Activation memory, measured" and "Activation
checkpointing").

A transformer block keeps tensors from its forward for its backward: a matrix multiplication
keeps its inputs, a softmax its output, a dropout its mask, a LayerNorm its input and two
statistics per token. Those are the **activations** whose bytes grow with the batch and the
sequence. This module measures them on a real forward and sets them beside Korthikanti et al.
(2022, *Reducing Activation Recomputation in Large Transformer Models*, §4.1), whose count for
one layer with 16-bit activations and 1-byte dropout masks is::

    s·b·h·(34 + 5·a·s/h) bytes          (s tokens, b sequences, hidden size h, a heads)

* :class:`Block` — notebook 08's GPT block (:class:`labkit.capstone.model.Block`, the same
  modules and parameters), its forward written out in Megatron's ``[s, b, h]`` layout so that
  every saved tensor is visible: ``attention="materialised"`` computes softmax(QKᵀ) as a tensor
  (the s² term), ``attention="sdpa"`` calls ``F.scaled_dot_product_attention`` (on this CPU
  build a flash kernel that keeps no s × s tensor). Dropout masks are a function of each
  element's global position (:func:`keep_mask`), 1 byte per element, so that one process,
  tensor parallelism and sequence parallelism drop the same elements;
  ``dropout="torch"`` uses ``F.dropout`` instead (on CPU it keeps a 4-byte mask).
* :class:`SavedTensors` — ``torch.autograd.graph.saved_tensors_hooks`` around a forward: every
  tensor autograd packs, labelled with the part of the block that saved it, counted by distinct
  storage (a view of a tensor already counted adds nothing) with the parameters left out.
* :func:`block_formula` — Korthikanti's count adapted to this block: bytes per element ``e``
  (4 in fp32), masks of ``m`` bytes: ``s·b·h·(16e + 2m) + a·s²·b·(2e + m)``, term by term, also
  split over N tensor-parallel ranks with or without sequence parallelism.
* :func:`measure_block`, :func:`sweep` — measured beside the formula, per term, per token.
* :func:`recompute_costs` — activation checkpointing (``torch.utils.checkpoint.checkpoint``,
  ``use_reentrant=False``) of the attention core ("selective", Korthikanti §5) or of each whole
  block ("full", Chen et al. 2016): bytes kept, forwards run, time, gradients equal.

Example::

    rows = measure_block(s=128, b=2, h=64, a=4)
    [(r["term"], r["measured"], r["formula"]) for r in rows]
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capstone.model import Block as GPTBlock
from ..capstone.model import GPTConfig
from ..sharding.memory import storage_key

__all__ = ["Block", "make_block", "keep_mask", "SavedTensors", "one_thread", "TERMS",
           "block_formula", "korthikanti_bytes", "measure_block", "sweep", "recompute_costs",
           "plot_sweep", "torch_dropout_mask_bytes", "ATTENTIONS", "DROPOUTS", "RECOMPUTES"]

ATTENTIONS = ("materialised", "sdpa")
DROPOUTS = ("hashed", "torch")
RECOMPUTES = ("none", "selective")          # inside the block; "full" wraps the whole block

# The parts of a block that keep something for backward, in forward order:
# (tag, region, coefficient of e·s·b·h, of m·s·b·h, of e·a·s²·b, of m·a·s²·b), where e is the
# bytes of an activation element and m of a mask element. Regions: "norm" (LayerNorm, split by
# sequence parallelism), "dropout" (the same), "column input" (the input of a column-parallel
# linear: whole on every tensor-parallel rank), "tp" (inside the tensor-parallel region: 1/N).
TERMS = (
    ("LayerNorm 1 input", "norm", 1, 0, 0, 0),
    ("QKV input", "column input", 1, 0, 0, 0),
    ("Q, K (inputs of QKᵀ)", "tp", 2, 0, 0, 0),
    ("softmax output", "tp", 0, 0, 1, 0),
    ("attention dropout mask", "tp", 0, 0, 0, 1),
    ("dropout output, V (inputs of ·V)", "tp", 1, 0, 1, 0),
    ("projection input", "tp", 1, 0, 0, 0),
    ("dropout mask after attention", "dropout", 0, 1, 0, 0),
    ("LayerNorm 2 input", "norm", 1, 0, 0, 0),
    ("fc input", "column input", 1, 0, 0, 0),
    ("GeLU input", "tp", 4, 0, 0, 0),
    ("fc2 input", "tp", 4, 0, 0, 0),
    ("dropout mask after the MLP", "dropout", 0, 1, 0, 0),
)
STATS = "LayerNorm statistics (mean, 1/σ)"   # 2 fp32 numbers per token per LayerNorm
SDPA = "SDPA: q, k, v, output, log-sum-exp"   # attention="sdpa" replaces rows 3 to 6
CHECKPOINT_INPUTS = "checkpoint inputs"

_tag = ["(outside a block)"]                  # the part of the block running now


def _mark(name: str) -> None:
    _tag[0] = name


# ----------------------------------------------------------------------------- dropout masks
_M = 2_147_483_647                            # 2^31 - 1: products stay inside int64


def _hash(index: torch.Tensor, seed: int) -> torch.Tensor:
    """A number in [0, 2³¹ - 1) for each global element index: three rounds of a multiplicative
    hash, in place, the same in every process. Its bits look independent enough for dropout
    (neighbouring indices and seeds are uncorrelated: tests/sequences_experts)."""
    x = (index + seed * 1_000_003).remainder_(_M)
    for mul in (48271, 69621, 16807):
        x.mul_(mul).add_(12345).remainder_(_M)
        x.bitwise_xor_(x >> 11)
    return x


def keep_mask(shape_offsets: Iterable[tuple[int, int, int]], p: float, seed: int) -> torch.Tensor:
    """Dropout's keep-mask (bool) for a block of a bigger tensor, from global positions.

    ``shape_offsets``: per dimension ``(size here, offset here, size of the whole)``: the mask of
    elements ``[offset, offset + size)`` of every dimension of a tensor of the whole sizes. Any
    process computing any piece of the same tensor gets the same bits for the same elements,
    which is what lets sequence-parallel ranks drop exactly what one process drops.
    """
    dims = list(shape_offsets)
    index = torch.zeros((), dtype=torch.int64)
    for d, (size, offset, whole) in enumerate(dims):
        pos = torch.arange(offset, offset + size, dtype=torch.int64)
        index = index * whole + pos.view([-1 if i == d else 1 for i in range(len(dims))])
    return _hash(index, seed) >= math.ceil(p * _M)


def _drop(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)     # keeps the bool mask, 1 B each


# ----------------------------------------------------------------------------- the block
class Block(GPTBlock):
    """Notebook 08's GPT block with its forward written out, input and output ``[s, b, h]``.

    ``x + dropout(proj(attention(qkv(ln1(x)))))``, then ``x + dropout(fc2(gelu(fc(ln2(x)))))``,
    causal attention, the same modules and parameters as :class:`labkit.capstone.model.Block`
    (``ln1``, ``attn.qkv``, ``attn.proj``, ``ln2``, ``mlp.fc``, ``mlp.proj``; its
    ``nn.Dropout`` modules are not used). Dropout probability ``cfg.dropout`` (training mode).

    Args:
        attention: ``"materialised"`` (QKᵀ, softmax, dropout, ·V as tensors) or ``"sdpa"``
            (``F.scaled_dot_product_attention(..., is_causal=True)``, no attention dropout).
        dropout: ``"hashed"`` (:func:`keep_mask`, 1-byte masks, the same in every layout) or
            ``"torch"`` (``F.dropout``; one process only).
        recompute: ``"none"`` or ``"selective"``: the attention core (QKᵀ to ·V) under
            ``checkpoint(..., use_reentrant=False)``, recomputed in backward.
        seed: the masks' seed.

    Tensor and sequence parallelism (:mod:`labkit.sequences_experts.sequence_parallel`) change
    only the hooks ``_column``, ``_row``, ``_sequence`` and the attributes ``heads_here``,
    ``head_offset``.
    """

    def __init__(self, cfg: GPTConfig, attention: str = "materialised", dropout: str = "hashed",
                 recompute: str = "none", seed: int = 0) -> None:
        super().__init__(cfg)
        for name, value, allowed in (("attention", attention, ATTENTIONS),
                                     ("dropout", dropout, DROPOUTS),
                                     ("recompute", recompute, RECOMPUTES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}.")
        self.cfg, self.attention, self.dropout_kind = cfg, attention, dropout
        self.recompute, self.seed, self.p = recompute, seed, float(cfg.dropout)
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.heads_here, self.head_offset = cfg.n_head, 0        # one process: every head
        self.calls = {"forward": 0, "attention core": 0}

    # --- the layout hooks (one process: plain linears; tensor parallelism overrides them) ---
    def _column(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return F.linear(x, linear.weight, linear.bias)

    def _row(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return F.linear(x, linear.weight) + linear.bias

    def _sequence(self, local: int) -> tuple[int, int]:
        """(offset of this rank's first token, tokens in all) for a tensor of ``local`` tokens."""
        return 0, local

    # --- dropout ---
    def _dropout(self, x: torch.Tensor, site: int, offsets=None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.dropout_kind == "torch":
            return F.dropout(x, self.p, True)
        if offsets is None:                    # [s, b, h] on the residual stream
            s_here, b, h = x.shape
            first, s_all = self._sequence(s_here)
            offsets = ((s_here, first, s_all), (b, 0, b), (h, 0, h))
        return _drop(x, keep_mask(offsets, self.p, 16 * self.seed + site), self.p)

    # --- attention ---
    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ/√d + causal) · V, dropout on the probabilities; q, k, v: [b, heads, s, d]."""
        self.calls["attention core"] += 1
        b, heads, s, d = q.shape
        _mark("Q, K (inputs of QKᵀ)")
        scores = q @ k.transpose(-2, -1)
        causal = torch.full((s, s), float("-inf")).triu(1)       # added: nothing kept
        scores = scores * (1.0 / math.sqrt(d)) + causal
        _mark("softmax output")
        probs = torch.softmax(scores, dim=-1)
        _mark("attention dropout mask")
        probs = self._dropout(probs, 1, ((b, 0, b), (heads, self.head_offset, self.n_head),
                                         (s, 0, s), (s, 0, s)))
        _mark("dropout output, V (inputs of ·V)")
        return probs @ v

    def _attention(self, y: torch.Tensor) -> torch.Tensor:
        d, heads = self.head_dim, self.heads_here
        _mark("QKV input")
        qkv = self._column(y, self.attn.qkv)                     # [s, b, 3 · heads · d]
        s, b = qkv.shape[:2]                  # the whole sequence (sequence parallelism: y is 1/N)
        q, k, v = (t.view(s, b, heads, d).permute(1, 2, 0, 3)   # [b, heads, s, d]
                   for t in qkv.split(heads * d, dim=-1))
        if self.attention == "sdpa":
            _mark(SDPA)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.recompute == "selective" and torch.is_grad_enabled():
            _mark(CHECKPOINT_INPUTS)
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, heads * d)  # a copy: the projection's input
        _mark("projection input")
        return self._row(out, self.attn.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["forward"] += 1
        _mark("LayerNorm 1 input")
        y = self.ln1(x)
        y = self._attention(y)
        _mark("dropout mask after attention")
        x = x + self._dropout(y, 2)
        _mark("LayerNorm 2 input")
        y = self.ln2(x)
        _mark("fc input")
        y = self._column(y, self.mlp.fc)
        _mark("GeLU input")
        y = F.gelu(y)
        _mark("fc2 input")
        y = self._row(y, self.mlp.proj)
        _mark("dropout mask after the MLP")
        out = x + self._dropout(y, 3)
        _mark("(outside a block)")
        return out


def make_block(h: int = 64, a: int = 4, p: float = 0.1, attention: str = "materialised",
               dropout: str = "hashed", recompute: str = "none", seed: int = 0,
               block_size: int = 4096) -> Block:
    """A :class:`Block` of hidden size ``h`` with ``a`` heads, dropout ``p``, in training mode;
    its weights depend only on ``seed`` (the global random state is left alone)."""
    if h % a:
        raise ValueError(f"hidden size h={h} must be a multiple of the heads a={a}.")
    cfg = GPTConfig(block_size=block_size, n_layer=1, n_head=a, n_embd=h, dropout=p)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = Block(cfg, attention=attention, dropout=dropout, recompute=recompute, seed=seed)
    return block.train()


def _input(s: int, b: int, h: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, h, generator=g)


# ----------------------------------------------------------------------------- measuring
@contextmanager
def one_thread():
    """Run torch on one thread inside the block (restored after). On a shared machine with
    few cores, intra-op threads that wait for each other make small operations many times slower
    and their times meaningless; the ranks of ``lk.run`` use one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SavedTensors:
    """What autograd keeps for backward inside the block, by distinct storage.

    ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` calls ``pack`` with every tensor
    an operation saves for its backward, as the forward runs; here ``pack`` notes the tensor's
    storage (address, bytes) and the part of the block running (the tags :class:`Block` sets)
    and returns the tensor unchanged. A storage is counted once, for the first part that
    saved it (a view of a tensor already kept costs nothing more); the storages of ``exclude``
    (the parameters: they exist anyway) are not counted.

    Example::

        with SavedTensors(exclude=block.parameters()) as saved:
            y = block(x)
        saved.total, saved.by_tag()
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {storage_key(t) for t in exclude}
        self._seen: dict[tuple, tuple[str, int]] = {}
        self.packed = 0                                          # tensors packed, views included
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        key = storage_key(t)
        if key not in self._skip and key[1] != 0 and key not in self._seen:
            tag = _tag[0]
            if tag.startswith("LayerNorm") and t.dim() >= 1 and t.shape[-1] == 1:
                tag = STATS                                      # mean and 1/σ, one per token
            self._seen[key] = (tag, t.untyped_storage().nbytes())
        return t

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        """Bytes of the distinct storages saved (parameters left out)."""
        return sum(n for _, n in self._seen.values())

    def by_tag(self) -> dict[str, int]:
        """Bytes per part of the block, in the order the parts first saved something."""
        out: dict[str, int] = {}
        for tag, n in self._seen.values():
            out[tag] = out.get(tag, 0) + n
        return out


# ----------------------------------------------------------------------------- formulas
def block_formula(s: int, b: int, h: int, a: int, n: int = 1, layout: str = "one process",
                  e: int = 4, m: int = 1, stats: bool = True) -> dict[str, float]:
    """Bytes this block keeps per rank, term by term (:data:`TERMS`), by Korthikanti's count.

    ``e``: bytes per activation element (4 fp32, 2 for 16-bit); ``m``: bytes per mask
    element. ``layout``: ``"one process"``, ``"tp"`` (tensor parallelism on ``n`` ranks:
    the ``tp`` region divided by n, the rest whole on every rank), ``"tp+sp"`` (sequence
    parallelism too: LayerNorm and dropout regions divided by n; the column-parallel linears'
    gathered inputs stay whole) or ``"tp+sp regather"`` (those inputs kept as the 1/n shard and
    all-gathered again in backward, as Megatron-LM does: everything divided by n).
    ``stats``: add the LayerNorms' mean and 1/σ (2 fp32 per token each), which the paper leaves
    out. The total is ``sum(result.values())``.
    """
    split = {"one process": set(), "tp": {"tp"}, "tp+sp": {"tp", "norm", "dropout"},
             "tp+sp regather": {"tp", "norm", "dropout", "column input"}}
    if layout not in split:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(split)}.")
    sbh, as2b = s * b * h, a * s * s * b
    out = {}
    for tag, region, ce, cm, ze, zm in TERMS:
        bytes_ = (ce * e + cm * m) * sbh + (ze * e + zm * m) * as2b
        out[tag] = bytes_ / n if region in split[layout] else float(bytes_)
    if stats:
        out[STATS] = 2 * 2 * 4 * s * b / (n if "norm" in split[layout] else 1)
    return out


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """The paper's bytes per layer, 16-bit activations (§4.1, §4.2): no parallelism
    ``sbh(34 + 5as/h)``; tensor parallelism ``sbh(10 + 24/t + 5as/(ht))``; with sequence
    parallelism ``sbh(34 + 5as/h)/t``."""
    sbh, r = s * b * h, 5 * a * s / h
    if sp:
        return sbh * (34 + r) / t
    return sbh * (10 + 24 / t + r / t)


def _saved(block: nn.Module, x: torch.Tensor) -> SavedTensors:
    with SavedTensors(exclude=list(block.parameters())) as saved:
        block(x)
    return saved


@one_thread()
def measure_block(s: int = 128, b: int = 2, h: int = 64, a: int = 4, p: float = 0.1,
                  attention: str = "materialised", dropout: str = "hashed") -> list[dict]:
    """One forward of a :class:`Block`: per term, the bytes measured and the formula's (fp32).

    Rows ``{"term", "measured", "formula"}`` (formula ``None`` for the LayerNorm statistics,
    which the paper leaves out), then a ``"total"`` row whose formula is ``s·b·h·66 + a·s²·b·9``
    (fp32, 1-byte masks). With SDPA the rows from Q, K to the projection's input become one:
    q, k, v and the output, ``4·4·s·b·h``, plus a log-sum-exp per query and head, ``4·a·s·b``.
    """
    block = make_block(h, a, p, attention=attention, dropout=dropout)
    x = _input(s, b, h).requires_grad_()
    measured = _saved(block, x).by_tag()
    formula = block_formula(s, b, h, a, stats=False)
    if attention == "sdpa":      # q, k, v (views of one tensor), the output, a log-sum-exp
        for tag in TERMS[2:7]:   # per query and head; the projection's input is a view of
            formula.pop(tag[0])  # the output, so it is counted in this row
        formula[SDPA] = 4 * 4 * s * b * h + 4 * a * s * b
    rows = [{"term": t, "measured": measured.get(t, 0), "formula": formula.get(t)}
            for t in list(formula) + [STATS] if measured.get(t) or formula.get(t)]
    rows.append({"term": "total", "measured": sum(measured.values()),
                 "formula": sum(formula.values())})
    return rows


@one_thread()
def sweep(seq_lens: Iterable[int] = (32, 64, 128, 256), b: int = 2, h: int = 64,
          a: int = 4) -> list[dict]:
    """Bytes one block keeps, measured, for each sequence length: materialised attention, SDPA,
    and the fp32 formula (:func:`block_formula`, statistics included) for the materialised one."""
    rows = []
    for s in seq_lens:
        x = _input(s, b, h).requires_grad_()
        row = {"s": s}
        for attention in ATTENTIONS:
            block = make_block(h, a, 0.1, attention=attention)
            row[attention] = _saved(block, x).total
        row["formula"] = sum(block_formula(s, b, h, a).values())
        row["formula_linear"] = row["formula"] - 9 * a * s * s * b    # without the s² terms
        rows.append(row)
    return rows


def torch_dropout_mask_bytes(numel: int = 1024) -> int:
    """Bytes ``F.dropout`` (training, p=0.1) keeps for backward of a ``numel``-element fp32
    tensor on this machine's CPU (1 per element would be a byte mask; 4 is an fp32 one)."""
    x = torch.randn(numel, requires_grad=True)
    with SavedTensors(exclude=[x]) as saved:
        F.dropout(x, 0.1, True)
    return saved.total


# ----------------------------------------------------------------------------- recomputation
def _stack(s: int, b: int, h: int, a: int, layers: int, recompute: str) -> nn.ModuleList:
    return nn.ModuleList(make_block(h, a, 0.1, seed=i,
                                    recompute="selective" if recompute == "selective" else "none")
                         for i in range(layers))


def _run_stack(blocks: nn.ModuleList, x: torch.Tensor, full: bool) -> torch.Tensor:
    for block in blocks:
        if full:
            _mark(CHECKPOINT_INPUTS)
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x


@one_thread()
def recompute_costs(s: int = 64, b: int = 2, h: int = 64, a: int = 4, layers: int = 2,
                    rounds: int = 5, timer: Callable[[], float] = time.perf_counter) -> list[dict]:
    """A stack of ``layers`` blocks, three ways: no recomputation, ``"selective"`` (each block's
    attention core checkpointed) and ``"full"`` (each block checkpointed).

    Per way: ``saved`` (bytes kept after the forward, all layers), ``saved_per_layer``,
    ``by_tag``, ``forwards`` (forwards of a block run in one forward + backward), ``cores``
    (attention cores run), ``max_grad_diff`` against no recomputation (input and every
    parameter) and ``equal`` (bitwise). Times, this machine: ``fwd_bwd_ms`` and ``fwd_ms``,
    medians over ``rounds`` rounds in which the three ways run in turn (the order rotated every
    round, so that a change of load hits them alike), on one thread (:func:`one_thread`).
    """
    x0 = _input(s, b, h)
    w = _input(s, b, h, seed=2)                     # loss = <output, w>: every gradient differs
    ways = ("none", "selective", "full")
    stacks = {way: _stack(s, b, h, a, layers, way) for way in ways}
    out, ref = {}, None
    for way in ways:
        blocks = stacks[way]
        params = [p for blk in blocks for p in blk.parameters()]
        x = x0.clone().requires_grad_()
        with SavedTensors(exclude=params) as saved:
            y = _run_stack(blocks, x, way == "full")
        _mark("(outside a block)")
        for blk in blocks:
            blk.calls = {k: 0 for k in blk.calls}
        (y * w).sum().backward()
        grads = [x.grad] + [p.grad for p in params]
        ref = grads if ref is None else ref
        out[way] = {"way": way, "saved": saved.total, "saved_per_layer": saved.total / layers,
                    "by_tag": saved.by_tag(),
                    "forwards": blocks[0].calls["forward"] + 1,       # + the forward above
                    "cores": blocks[0].calls["attention core"] + 1,
                    "max_grad_diff": max(float((g - r).abs().max()) for g, r in zip(grads, ref)),
                    "equal": all(torch.equal(g, r) for g, r in zip(grads, ref)),
                    "fwd": [], "fwd_bwd": []}
    for k in range(rounds):
        for way in ways[k % 3:] + ways[:k % 3]:
            xr = x0.clone().requires_grad_()
            t0 = timer()
            yr = _run_stack(stacks[way], xr, way == "full")
            t1 = timer()
            (yr * w).sum().backward()
            t2 = timer()
            out[way]["fwd"].append(1e3 * (t1 - t0))
            out[way]["fwd_bwd"].append(1e3 * (t2 - t0))
    _mark("(outside a block)")
    for row in out.values():
        row["fwd_ms"] = statistics.median(row.pop("fwd"))
        row["fwd_bwd_ms"] = statistics.median(row.pop("fwd_bwd"))
    return [out[way] for way in ways]


# ----------------------------------------------------------------------------- picture
def plot_sweep(rows: list[dict], ax=None, title: str = "what one block keeps for backward"):
    """Bytes per layer against the sequence length: measured (dots) and the formula (lines)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    s = [r["s"] for r in rows]
    kib = 1 / 1024
    ax.plot(s, [r["formula"] * kib for r in rows], "-", color="C0",
            label="formula, materialised: s·b·h·66 + a·s²·b·9 (+ LN stats)")
    ax.plot(s, [r["formula_linear"] * kib for r in rows], "--", color="C0", alpha=0.6,
            label="the same without the a·s²·b terms")
    ax.plot(s, [r["materialised"] * kib for r in rows], "o", color="C0",
            label="measured, softmax(QKᵀ) materialised")
    ax.plot(s, [r["sdpa"] * kib for r in rows], "s", color="C2",
            label="measured, F.scaled_dot_product_attention (CPU flash)")
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("KiB kept per layer")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax
