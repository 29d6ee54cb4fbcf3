"""Notebook 09 §10–§13 — a mixture-of-experts layer on one process, then with its experts
spread over ranks (expert parallelism: all-to-all dispatch and combine).

The layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):

* **experts** — E small MLPs (:class:`Expert`: Linear → ReLU → Linear, d → h → d);
* **router** — a linear map d → E; ``softmax`` of its logits gives each token a probability per
  expert, and the token goes to its **top-k** experts (k = 1: Switch; k = 2: GShard);
* **gate** — what the expert's output is multiplied by: the top probability for k = 1 (Switch:
  the router learns through it), the two top probabilities renormalised to sum to 1 for k = 2
  (GShard);
* **capacity** — each expert takes at most ``C = ceil(capacity_factor · T · k / E)``
  assignments of a batch of T tokens (:func:`capacity`). Assignments are served in a fixed
  order: every token's first choice, in token order, then every token's second choice, in token
  order (GShard's priority of first choices); an expert that is full **drops** the rest. A
  dropped assignment adds nothing: a token with all its assignments dropped gets output 0 (in a
  transformer block ``x + moe(x)`` it passes through on the residual). ``capacity_factor=None``
  drops nothing;
* **load-balancing loss** — ``E · Σ_e f_e · P_e`` (:func:`load_balancing_loss`): f_e is the
  fraction of tokens whose first choice is e, P_e the mean router probability of e. It is 1
  when both are uniform, up to E when everything goes to one expert; its gradient reaches the
  router through P (f is a count).

Expert parallelism (:class:`ExpertParallelMoE`): E experts over N ranks (E % N == 0), rank r
owning experts ``r·E/N … (r+1)·E/N − 1``. Each rank routes its own tokens (capacity per rank,
GShard's "group"), then

1. ``all_to_all_single`` of the per-expert **counts** (E integers): each rank learns how many
   tokens it will receive from every rank, for each of its experts;
2. ``all_to_all_single`` of the **tokens**, sorted by expert (so by destination rank), with
   ``input_split_sizes`` (what goes to each rank) and ``output_split_sizes`` (what comes from
   each) — the **dispatch**;
3. each local expert runs on the tokens it received;
4. ``all_to_all_single`` back with the split sizes swapped — the **combine** — then the rows
   are put back in token order and weighted by their gates.

Backward runs the two token exchanges in reverse (:class:`AllToAll`, an autograd function).
Rank r's output equals the one-process :class:`MoE` on rank r's tokens; every expert's gradient
(on its owner) equals the one-process gradient of the sum of every rank's loss; the router's
gradient on rank r is that of rank r's loss (averaged over the ranks in training, like any
replicated weight's; the experts' gradients, which already sum every rank's tokens, stay out of
that average).

Bytes (:func:`a2a_bytes`, checked against the kernel's TCP counters of gloo's sockets,
:mod:`labkit.grading.watch`): per token exchange a rank sends the rows that leave it,
``4·d`` bytes each in fp32, and gloo adds :data:`HEADER_BYTES` per message, one message to
every other rank even when it is empty.

:func:`dispatch_combine` is the lesson's own answer to the exercise ``09.moe_dispatch`` (marked
with :func:`labkit.grading.references.reference`: an answer that calls it fails).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..grading.references import reference

__all__ = ["HEADER_BYTES", "Expert", "MoE", "Routing", "capacity", "route",
           "load_balancing_loss", "owner", "AllToAll", "all_to_all", "exchange_counts",
           "dispatch_combine", "ExpertParallelMoE", "a2a_bytes", "batch", "skewed",
           "ep_vs_one_process", "imbalance_job", "measure_imbalance", "drops_by_capacity",
           "plot_tokens_per_expert", "plot_drops", "bench_rows", "bench_table"]

HEADER_BYTES = 144    # gloo's framing per message of an all_to_all, whatever its size (torch 2.13)


# ------------------------------------------------------------------ one process
def capacity(tokens: int, num_experts: int, k: int = 1,
             capacity_factor: float | None = 1.25) -> int:
    """Assignments one expert takes from a batch: ``ceil(capacity_factor · tokens · k / E)``.

    Exact in decimal (1.1 · 10 is 11, not 12), ``None``: no limit (``tokens · k``).

    >>> capacity(16, 4, 1, 1.25), capacity(10, 1, 1, 1.1), capacity(6, 4, 2, None)
    (5, 11, 12)
    """
    if capacity_factor is None:
        return tokens * k
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive (or None: no limit), got "
                         f"{capacity_factor!r}.")
    return math.ceil(Fraction(repr(float(capacity_factor))) * tokens * k / num_experts)


@dataclass
class Routing:
    """Where the tokens of one batch go (:func:`route`).

    ``experts[t, j]``: token t's j-th choice; ``gates[t, j]``: its weight; ``keep[t, j]``: False
    when that expert was full. Counts are per expert: ``routed`` (assignments asked for),
    ``kept`` (served, at most ``capacity``).
    """

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor
    capacity: int
    aux_loss: torch.Tensor
    routed: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        """Assignments dropped (over capacity)."""
        return int((~self.keep).sum())

    @property
    def dropped_tokens(self) -> int:
        """Tokens with every assignment dropped: their output is 0."""
        return int((~self.keep).all(dim=1).sum())

    def assignments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept assignments in token order: (token index, choice index, expert)."""
        t, j = self.keep.nonzero(as_tuple=True)
        return t, j, self.experts[t, j]


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch/GShard's auxiliary loss ``E · Σ_e f_e · P_e`` (f: share of first choices, P: mean
    probability). 1 when balanced, E when every token picks one expert with probability 1."""
    T, E = probs.shape
    f = torch.bincount(first_choice, minlength=E).to(probs.dtype) / max(T, 1)
    return E * (f * probs.sum(dim=0) / max(T, 1)).sum()      # 0 for an empty batch


def route(logits: torch.Tensor, k: int = 1, capacity_factor: float | None = 1.25) -> Routing:
    """Top-k routing with a capacity per expert (module docstring: gates, order of drops)."""
    if k not in (1, 2):
        raise ValueError(f"k must be 1 (Switch) or 2 (GShard), got {k!r}.")
    T, E = logits.shape
    if k > E:
        raise ValueError(f"k={k} needs at least {k} experts, got num_experts={E}.")
    probs = logits.softmax(dim=-1)
    top_p, top_e = probs.topk(k, dim=-1)
    gates = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    cap = capacity(T, E, k, capacity_factor)
    queue = top_e.t().reshape(-1)                   # first choices in token order, then second
    onehot = F.one_hot(queue, E)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # 0, 1, 2 ... in its expert's queue
    keep = (place < cap).view(k, T).t()
    routed = torch.bincount(queue, minlength=E)
    kept = torch.bincount(queue[keep.t().reshape(-1)], minlength=E)
    return Routing(probs, top_e, gates, keep, cap, load_balancing_loss(probs, top_e[:, 0]),
                   routed.tolist(), kept.tolist())


class Expert(nn.Module):
    """One expert: Linear(d, h) → ReLU → Linear(h, d)."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_hidden), nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class MoE(nn.Module):
    """A mixture-of-experts layer on one process: the oracle of the expert-parallel one.

    Args:
        d_model, d_hidden: token width and each expert's hidden width.
        num_experts: E. k: 1 or 2 experts per token. capacity_factor: see :func:`capacity`.
        seed: the weights (every rank building ``MoE(seed=s)`` holds the same layer).

    ``logit_bias`` (a buffer, zeros) is added to the router's logits: :func:`skewed` sets it to
    send most tokens to chosen experts. ``forward(x)`` takes tokens ``[T, d]`` and returns
    ``(y, routing)``: ``y[t] = Σ_j gate · expert(x[t])`` over t's kept assignments.

    >>> moe = MoE(d_model=8, d_hidden=16, num_experts=4)
    >>> y, r = moe(torch.randn(10, 8))
    >>> y.shape, r.capacity, sum(r.routed)
    (torch.Size([10, 8]), 4, 10)
    """

    def __init__(self, d_model: int = 16, d_hidden: int = 32, num_experts: int = 4, k: int = 1,
                 capacity_factor: float | None = 1.25, seed: int = 0) -> None:
        super().__init__()
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.capacity_factor = capacity_factor
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(d_model, num_experts, bias=False)
            self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(num_experts))
        self.register_buffer("logit_bias", torch.zeros(num_experts))

    def route(self, x: torch.Tensor) -> Routing:
        return route(self.router(x) + self.logit_bias, self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        r = self.route(x)
        t, j, e = r.assignments()
        y = torch.zeros_like(x)
        for expert in range(self.num_experts):
            mine = e == expert
            if mine.any():
                rows = t[mine]
                out = self.experts[expert](x[rows]) * r.gates[rows, j[mine]].unsqueeze(-1)
                y = y.index_add(0, rows, out)
        return y, r


def skewed(moe: MoE, toward: Sequence[int], by: float = 3.0) -> MoE:
    """A copy of ``moe`` whose router adds ``by`` to the logits of the experts ``toward``: most
    tokens then pick them (an unbalanced router)."""
    out = copy.deepcopy(moe)
    out.logit_bias.zero_()
    out.logit_bias[list(toward)] = by
    return out


def batch(rank: int, tokens: int, d_model: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tokens ``[tokens, d_model]``, the same whoever draws them."""
    g = torch.Generator().manual_seed(1_000_003 * seed + rank)
    return torch.randn(tokens, d_model, generator=g)


# ------------------------------------------------------------------ across ranks
def owner(expert: int, experts_per_rank: int) -> int:
    """The rank that holds ``expert``: experts are dealt out in blocks of ``experts_per_rank``."""
    return expert // experts_per_rank


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with a backward: the gradient goes back with the splits
    swapped (``dist.all_to_all_single`` itself records nothing for autograd). Expert
    parallelism's dispatch and combine use it, and Ulysses (§7) with equal splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits),
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group=None):
    """Rows ``x`` split ``in_splits`` (to each rank) → rows split ``out_splits`` (from each)."""
    return AllToAll.apply(x, list(out_splits), list(in_splits), group)


@reference
def exchange_counts(per_expert: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-to-all of the per-expert counts: returns ``[world_size, experts_per_rank]``, row s =
    how many tokens rank s sends to each of this rank's experts."""
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert)
    return received.view(world_size, -1)


@reference
def dispatch_combine(tokens: torch.Tensor, expert_of_token: torch.Tensor,
                     experts_per_rank: int, expert_fn: Callable) -> torch.Tensor:
    """The lesson's answer to ``09.moe_dispatch``: send each token to the rank holding its
    expert, run ``expert_fn(j, rows)`` for each local expert j there, bring the rows back in
    token order."""
    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    per_expert = torch.bincount(expert_of_token, minlength=n * experts_per_rank)
    from_each = exchange_counts(per_expert, n)
    send = per_expert.view(n, -1).sum(1).tolist()
    recv = from_each.sum(1).tolist()
    got = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(got, tokens[order].contiguous(), recv, send)
    local = torch.arange(experts_per_rank).repeat(n).repeat_interleave(from_each.reshape(-1))
    out = torch.empty_like(got)
    for j in range(experts_per_rank):
        out[local == j] = expert_fn(j, got[local == j])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, out, send, recv)
    result = torch.empty_like(tokens)
    result[order] = back
    return result


class ExpertParallelMoE(nn.Module):
    """Rank r's part of ``moe`` with its experts over the ranks: the router (a copy on every
    rank) and experts ``r·E/N … (r+1)·E/N − 1`` only.

    ``forward(x)`` (this rank's tokens) returns ``(y, routing)`` like :class:`MoE` and leaves
    ``self.traffic = {"send_rows": [...], "recv_rows": [...], "counts": E}``: token rows sent
    to / received from each rank in the dispatch (the combine is the same the other way).
    ``self.timeline`` (a :class:`labkit.common.timeline.Timeline`, or None) gets a span
    ``"experts"`` around the local experts' forward. ``self.seconds_per_row`` (default 0)
    adds a sleep of that many seconds per row the local experts run on, in forward: a
    stand-in for an accelerator whose compute grows with its rows without taking one of
    this machine's shared CPU cores (notebook 07 stands in for a slow data loader the same way).
    """

    def __init__(self, moe: MoE, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        n = dist.get_world_size() if world_size is None else world_size
        r = dist.get_rank() if rank is None else rank
        E = moe.num_experts
        if E % n:
            raise ValueError(f"num_experts={E} is not a multiple of world_size={n}: expert "
                             f"parallelism gives every rank the same number of experts "
                             f"(choose num_experts as a multiple of {n}).")
        self.rank, self.world_size, self.num_experts = r, n, E
        self.experts_per_rank, self.k = E // n, moe.k
        self.capacity_factor, self.d_model = moe.capacity_factor, moe.d_model
        self.router = copy.deepcopy(moe.router)
        self.register_buffer("logit_bias", moe.logit_bias.detach().clone())
        first = r * self.experts_per_rank
        self.local = nn.ModuleList(copy.deepcopy(moe.experts[e])
                                   for e in range(first, first + self.experts_per_rank))
        self.owned = list(range(first, first + self.experts_per_rank))
        self.traffic: dict = {}
        self.timeline = None
        self.seconds_per_row = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        n, epr = self.world_size, self.experts_per_rank
        r = route(self.router(x) + self.logit_bias, self.k, self.capacity_factor)
        t, j, e = r.assignments()
        order = torch.argsort(e, stable=True)          # by expert, so by destination rank
        t, j, e = t[order], j[order], e[order]
        per_expert = torch.bincount(e, minlength=self.num_experts)
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert)   # 1. the counts
        from_each = received.view(n, epr)
        send = per_expert.view(n, epr).sum(1).tolist()
        recv = from_each.sum(1).tolist()
        got = all_to_all(x[t], recv, send)              # 2. dispatch
        local = torch.arange(epr).repeat(n).repeat_interleave(from_each.reshape(-1))
        grouped = torch.argsort(local, stable=True)     # 3. each local expert on its rows
        sizes = torch.bincount(local, minlength=epr).tolist()
        with self.timeline.span("experts") if self.timeline is not None else nullcontext():
            parts = [self.local[i](rows) for i, rows in enumerate(got[grouped].split(sizes))]
            if self.seconds_per_row:
                time.sleep(self.seconds_per_row * got.shape[0])
        out = torch.cat(parts)[torch.argsort(grouped)]
        back = all_to_all(out, send, recv)              # 4. combine
        y = torch.zeros_like(x).index_add(0, t, back * r.gates[t, j].unsqueeze(-1))
        self.traffic = {"send_rows": send, "recv_rows": recv, "counts": self.num_experts}
        return y, r


def a2a_bytes(send_rows: Sequence[int], recv_rows: Sequence[int], rank: int, d_model: int,
              experts_per_rank: int, element_size: int = 4, backward: bool = False,
              header: int = HEADER_BYTES) -> dict:
    """What one rank sends over gloo in one :class:`ExpertParallelMoE` forward (and backward):

    * counts: ``8 · E/N`` bytes (int64) to each of the N − 1 other ranks;
    * dispatch: ``d · element_size`` per row that leaves the rank (``send_rows`` less its own);
    * combine: the same per row that came in from another rank (``recv_rows`` less its own);
    * backward: the two token exchanges again, the other way round;
    * framing: ``header`` bytes per message, N − 1 messages per all-to-all, even empty ones.

    Returns ``{"payload", "framing", "total", "calls"}``.
    """
    n = len(send_rows)
    away = sum(send_rows) - send_rows[rank]
    came = sum(recv_rows) - recv_rows[rank]
    row = d_model * element_size
    tokens = row * (away + came) * (2 if backward else 1)
    payload = 8 * experts_per_rank * (n - 1) + tokens
    calls = 3 + (2 if backward else 0)
    framing = header * (n - 1) * calls
    return {"payload": payload, "framing": framing, "total": payload + framing, "calls": calls}


def ep_vs_one_process(rank: int, world_size: int, num_experts: int = 4, tokens: int = 64,
                      d_model: int = 16, d_hidden: int = 32, k: int = 1,
                      capacity_factor: float | None = 1.25, skew: float = 0.0,
                      seed: int = 0) -> dict:
    """In every rank: one forward and backward of :class:`ExpertParallelMoE` against the
    one-process :class:`MoE` with the same weights, and the bytes this rank sent.

    Loss of rank r: ``(y_r · w_r).sum() + 0.1 · aux_r`` (w_r fixed random). The oracle runs the
    one-process layer on every rank's batch (each its own group, as the ranks route) and sums
    the losses. Returns the largest differences (output, owned experts' gradients, router
    gradient of this rank's loss), the routing counts, and ``sent`` (forward, backward) from the
    kernel's TCP counters beside :func:`a2a_bytes`.
    """
    from ..grading.watch import store_port, tcp_bytes_sent
    moe = MoE(d_model, d_hidden, num_experts, k, capacity_factor, seed)
    if skew:
        moe = skewed(moe, range(num_experts // world_size), skew)
    ep = ExpertParallelMoE(moe)
    xs = [batch(r, tokens, d_model, seed).requires_grad_() for r in range(world_size)]
    ws = [batch(r + 100, tokens, d_model, seed) for r in range(world_size)]
    x = xs[rank].detach().clone().requires_grad_()
    port = store_port()
    dist.barrier()
    b0 = tcp_bytes_sent(port) or 0
    y, routing = ep(x)
    b1 = tcp_bytes_sent(port) or 0
    ((y * ws[rank]).sum() + 0.1 * routing.aux_loss).backward()
    b2 = tcp_bytes_sent(port) or 0
    # the oracle: one process, every rank's batch, each routed as its own group
    outs, total = [], 0.0
    for r in range(world_size):
        yr, rr = moe(xs[r])
        outs.append(yr)
        total = total + (yr * ws[r]).sum() + 0.1 * rr.aux_loss
    total.backward()
    owned = [p for i in ep.owned for p in moe.experts[i].parameters()]
    mine = [p for m in ep.local for p in m.parameters()]
    alone = copy.deepcopy(moe)               # rank r's loss alone: the router's gradient here
    alone.zero_grad(set_to_none=True)
    ya, ra = alone(xs[rank].detach())
    ((ya * ws[rank]).sum() + 0.1 * ra.aux_loss).backward()
    tr = ep.traffic
    fwd = a2a_bytes(tr["send_rows"], tr["recv_rows"], rank, d_model, ep.experts_per_rank)
    both = a2a_bytes(tr["send_rows"], tr["recv_rows"], rank, d_model, ep.experts_per_rank,
                     backward=True)
    return {"rank": rank, "owned": ep.owned,
            "out_diff": _diff(y, outs[rank]),
            "input_grad_diff": _diff(x.grad, xs[rank].grad),
            "expert_grad_diff": max(_diff(a.grad, b.grad) for a, b in zip(mine, owned)),
            "router_grad_diff": _diff(ep.router.weight.grad, alone.router.weight.grad),
            "expert_params_here": sum(p.numel() for p in ep.local.parameters()),
            "expert_params_all": sum(p.numel() for p in moe.experts.parameters()),
            "routed": routing.routed, "kept": routing.kept, "capacity": routing.capacity,
            "dropped": routing.dropped, "dropped_tokens": routing.dropped_tokens,
            "aux_loss": float(routing.aux_loss), "send_rows": tr["send_rows"],
            "recv_rows": tr["recv_rows"], "sent_forward": b1 - b0, "sent_backward": b2 - b1,
            "formula_forward": fwd, "formula_both": both}


def _diff(a, b) -> float:
    """max |a - b|, a missing gradient read as zeros (an expert no token reached)."""
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------ an unbalanced router
def imbalance_job(rank: int, world_size: int, skews: Sequence[float] = (0.0, 3.0),
                  rounds: int = 6, tokens: int = 512, d_model: int = 64, d_hidden: int = 256,
                  num_experts: int = 4, capacity_factor: float | None = None,
                  seconds_per_row: float = 0.0, seed: int = 0, timeline: bool = False) -> dict:
    """In every rank: forward + backward steps of :class:`ExpertParallelMoE`, one per skew in
    turn (alternating order, the first round a warm-up), the router pushed toward rank 0's
    experts by ``skew``. Step time: barrier, step, barrier (the slowest rank ends the step).
    ``seconds_per_row``: the experts' stand-in cost (:class:`ExpertParallelMoE`).

    Returns ``{"step_s": {skew: [...]}, "expert_s": {skew: [...]}, "rows": {skew: rows this
    rank's experts ran}, "dropped": {skew: ...}, "spans": [...] (when ``timeline``)}``.
    """
    from ..common.timeline import Timeline
    from ..scaling.timing import alternating
    base = MoE(d_model, d_hidden, num_experts, 1, capacity_factor, seed)
    layers = {s: ExpertParallelMoE(skewed(base, range(num_experts // world_size), s) if s
                                   else base) for s in skews}
    x = batch(rank, tokens, d_model, seed)
    tl = Timeline(rank)
    out = {"step_s": {s: [] for s in skews}, "expert_s": {s: [] for s in skews},
           "rows": {}, "dropped": {}}
    for layer in layers.values():
        layer.seconds_per_row = seconds_per_row
    for i, order in enumerate(alternating(list(skews), rounds + 1)):
        for s in order:
            layer = layers[s]
            layer.timeline = Timeline(rank)
            dist.barrier()
            t0 = time.perf_counter()
            y, r = layer(x)
            with tl.span("backward"):
                (y.square().mean() + 0.01 * r.aux_loss).backward()
            dist.barrier()
            t1 = time.perf_counter()
            if i:
                out["step_s"][s].append(t1 - t0)
                out["expert_s"][s].append(sum(sp["end"] - sp["start"]
                                              for sp in layer.timeline.spans))
            out["rows"][s] = sum(layer.traffic["recv_rows"])
            out["dropped"][s] = r.dropped
            if timeline:
                tl.spans.extend(layer.timeline.spans)
            layer.zero_grad(set_to_none=True)
    if timeline:
        out["spans"] = tl.spans
    return out


def measure_imbalance(world_size: int = 2, skews: Sequence[float] = (0.0, 3.0),
                      rounds: int = 6, **kw) -> list[dict]:
    """Step time of the balanced and the skewed router on real ranks (:func:`imbalance_job`;
    ``kw`` goes to it): one row per skew, ``{skew, step_ms (median of the slowest rank),
    per_rank_expert_ms, rows_per_rank, dropped, seconds_per_row}``."""
    from ..runtime import run
    from ..scaling.timing import slowest_runs
    vals = run(imbalance_job, world_size, kwargs=dict(skews=tuple(skews), rounds=rounds, **kw),
               timeout=60, echo=False).values
    rows = []
    for s in skews:
        steps = slowest_runs([v["step_s"][s] for v in vals])
        rows.append({"skew": s, "world_size": world_size,
                     "step_ms": statistics.median(steps) * 1e3,
                     "per_rank_expert_ms": [statistics.median(v["expert_s"][s]) * 1e3
                                            for v in vals],
                     "rows_per_rank": [v["rows"][s] for v in vals],
                     "dropped": sum(v["dropped"][s] for v in vals),
                     "seconds_per_row": kw.get("seconds_per_row", 0.0)})
    return rows


# ------------------------------------------------------------------ pictures
def drops_by_capacity(factors: Sequence[float] = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
                      ks: Sequence[int] = (1, 2), tokens: int = 256, num_experts: int = 8,
                      d_model: int = 16, seed: int = 0) -> list[dict]:
    """Share of assignments and of tokens dropped, per capacity factor and k (one process)."""
    rows = []
    x = batch(0, tokens, d_model, seed)
    for k in ks:
        for cf in factors:
            moe = MoE(d_model, 2 * d_model, num_experts, k, cf, seed)
            with torch.no_grad():
                r = moe.route(x)
            rows.append({"k": k, "capacity_factor": cf, "capacity": r.capacity,
                         "dropped": r.dropped / (tokens * k),
                         "dropped_tokens": r.dropped_tokens / tokens})
    return rows


def plot_tokens_per_expert(routings: dict, title: str = ""):
    """Bars: assignments routed to each expert, the kept part solid, the dropped part hatched,
    and each routing's capacity as a line. ``routings``: ``{label: Routing}``."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(routings), figsize=(4.2 * len(routings), 3.0),
                             layout="constrained", squeeze=False)
    for ax, (label, r) in zip(axes[0], routings.items()):
        e = range(len(r.routed))
        ax.bar(e, r.kept, color="#2A9D8F", label="kept")
        ax.bar(e, [a - b for a, b in zip(r.routed, r.kept)], bottom=r.kept, color="white",
               edgecolor="#E76F51", hatch="//", label="dropped")
        ax.axhline(r.capacity, color="black", ls="--", lw=1, label="capacity")
        ax.set_xticks(list(e))
        ax.set_ylim(0, 1.12 * max(max(r.routed, default=0), r.capacity, 1))
        ax.set_xlabel("expert")
        ax.set_title(f"{label}: capacity {r.capacity}, load-balancing loss "
                     f"{float(r.aux_loss):.2f}", fontsize=9)
    axes[0][0].set_ylabel("assignments")
    axes[0][-1].legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_drops(rows: list[dict], title: str = ""):
    """Share of assignments dropped against the capacity factor, one line per k."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.0), layout="constrained")
    for k in sorted({r["k"] for r in rows}):
        mine = [r for r in rows if r["k"] == k]
        ax.plot([r["capacity_factor"] for r in mine], [100 * r["dropped"] for r in mine],
                marker="o", label=f"top-{k}")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("assignments dropped (%)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_title(title, fontsize=10)
    return fig


# ------------------------------------------------------------------ the benchmark
def _time_steps(rank, world_size, groups, tokens, d_model, d_hidden, num_experts, rounds,
                seed):
    """Forward + backward of the EP layer (N ranks) or, on 1 rank, of the whole MoE on the
    tokens of ``groups`` ranks: the times of ``rounds`` steps after a warm-up."""
    moe = MoE(d_model, d_hidden, num_experts, 1, None, seed)
    if world_size == 1:
        layer = moe
        x = torch.cat([batch(r, tokens, d_model, seed) for r in range(groups)])
    else:
        layer, x = ExpertParallelMoE(moe), batch(rank, tokens, d_model, seed)
    times = []
    for i in range(rounds + 1):
        if world_size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        y, r = layer(x)
        (y.square().mean() + 0.01 * r.aux_loss).backward()
        if world_size > 1:
            dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
    return times


def bench_rows(world_sizes: Sequence[int] = (2, 4), sizes: Sequence[int] = (2 ** 16, 2 ** 20),
               rounds: int = 8, tokens: int = 512, d_model: int = 64, d_hidden: int = 256,
               num_experts: int = 4, stand_in: float = 20e-6,
               progress: bool = False) -> list[dict]:
    """Rows for ``python -m labkit bench sequences``, each ``{"table", ...}``:

    * ``"all_to_all"`` — :func:`labkit.scaling.costs.measure_costs` of ``all_to_all_single``
      against its α–β formula (α, β fitted to the all-reduce), per world size and size;
    * ``"imbalance"`` — the EP layer's step, balanced vs skewed router (no capacity limit),
      per world size (:func:`measure_imbalance`), the experts' real compute alone, then with
      the stand-in cost of ``stand_in`` seconds per row (what an accelerator that does not
      share this machine's cores would show);
    * ``"ep_vs_one"`` — the EP layer on N ranks vs the whole MoE on one process taking all N
      ranks' tokens: step ms and speedup.
    """
    from ..runtime import run
    from ..scaling.costs import cost_rows, measure_costs
    from ..scaling.timing import slowest_runs
    rows = []
    costs = cost_rows(measure_costs(tuple(sizes), tuple(world_sizes),
                                    collectives=("all_reduce", "all_to_all"), iters=rounds,
                                    progress=progress))
    rows += [{"table": "all_to_all", **r} for r in costs if r["collective"] == "all_to_all"]
    cfg = dict(tokens=tokens, d_model=d_model, d_hidden=d_hidden, num_experts=num_experts)
    for n in world_sizes:
        if num_experts % n:
            continue
        for per_row in (0.0, stand_in):
            for r in measure_imbalance(n, rounds=rounds, seconds_per_row=per_row, **cfg):
                rows.append({"table": "imbalance", **r})
        args = (n, tokens, d_model, d_hidden, num_experts, rounds, 0)
        ep = run(_time_steps, n, args=args, timeout=60, echo=False).values
        one = run(_time_steps, 1, args=args, timeout=60, echo=False).values[0]
        ep_ms = statistics.median(slowest_runs(ep)) * 1e3
        one_ms = statistics.median(one) * 1e3
        rows.append({"table": "ep_vs_one", "world_size": n, "tokens": n * tokens,
                     "ep_ms": ep_ms, "one_ms": one_ms, "speedup": one_ms / ep_ms})
    return rows


def bench_table(rows: list[dict]) -> str:
    """The three tables of :func:`bench_rows` as text."""
    from ..collectives.bandwidth import fmt_bytes
    out = ["all_to_all_single on gloo (median of the slowest rank; model: alpha-beta fitted to "
           "the all-reduce)",
           f"{'ranks':>5} {'S':>9} {'measured ms':>12} {'model ms':>9} {'x model':>8} "
           f"{'busbw GB/s':>11}"]
    for r in rows:
        if r["table"] == "all_to_all":
            out.append(f"{r['world_size']:>5} {fmt_bytes(r['bytes']):>9} "
                       f"{r['time_s'] * 1e3:>12.3f} {r['model_s'] * 1e3:>9.3f} "
                       f"{r['ratio']:>8.2f} {r['busbw']:>11.3f}")
    out += ["", "MoE step (forward + backward), balanced vs skewed router, no capacity limit",
            f"{'ranks':>5} {'stand-in us/row':>15} {'skew':>5} {'step ms':>8} "
            f"{'expert ms per rank':<24} rows per rank"]
    for r in rows:
        if r["table"] == "imbalance":
            per = ", ".join(f"{v:.1f}" for v in r["per_rank_expert_ms"])
            out.append(f"{r['world_size']:>5} {r['seconds_per_row'] * 1e6:>15g} "
                       f"{r['skew']:>5g} {r['step_ms']:>8.1f} {per:<24} {r['rows_per_rank']}")
    out += ["", "expert parallel on N ranks vs one process with every rank's tokens",
            f"{'ranks':>5} {'tokens':>7} {'EP ms':>8} {'1 process ms':>13} {'speedup':>8}"]
    for r in rows:
        if r["table"] == "ep_vs_one":
            out.append(f"{r['world_size']:>5} {r['tokens']:>7} {r['ep_ms']:>8.1f} "
                       f"{r['one_ms']:>13.1f} {r['speedup']:>8.2f}")
    return "\n".join(out)
