"""Gradient staleness: a real asynchronous parameter server, and a delay-k simulation (notebook 04).

In an asynchronous parameter server, workers pull the weights, compute a
gradient, and push it back *without waiting for each other*. By the time a
gradient arrives, other workers' updates have moved the weights on: its
**staleness** is the number of updates applied since the weights it was
computed on. Synchronous data parallelism (DDP) has staleness 0 by
construction: every rank waits in the all-reduce for every other.

* :func:`parameter_server` runs it for real on gloo: rank 0 serves, ranks
  1..N-1 work; point-to-point ``send``/``recv`` (the server receives from
  whichever worker is first) and the staleness of every update is measured.
  ``mode="sync"`` waits for all workers each round (what DDP does);
  ``mode="aware"`` divides the learning rate by the staleness
  (Zhang et al., 2016, "Staleness-aware Async-SGD for distributed deep learning").
* :func:`delayed_sgd` is a one-process **simulation** of a fixed delay ``k``:
  step ``t`` applies the gradient computed at the weights of step ``t - k``.
  On a quadratic with largest curvature 1, plain SGD with ``lr = 1`` converges
  without delay and diverges once ``k`` grows; ``lr / (k + 1)`` converges again.

Example::

    ps = lk.pitfalls.parameter_server(world_size=4, mode="async")
    ps.staleness[:10], ps.losses[-1]
    lk.pitfalls.delayed_sgd(delay=8, lr=1.0)[-1]     # a loss that has blown up
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime import run
from .scenario import scenario_fn

__all__ = ["quadratic", "delayed_sgd", "staleness_sweep", "parameter_server", "PSRun",
           "mean_staleness"]

DIM = 8


def quadratic(dim: int = DIM, n: int = 256, seed: int = 0):
    """A least-squares problem ``A w ~ b`` scaled so the Hessian's largest eigenvalue is 1."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, dim, generator=g, dtype=torch.float64) * torch.linspace(0.3, 1.0, dim,
                                                                               dtype=torch.float64)
    h = a.T @ a / n
    a = a / math.sqrt(float(torch.linalg.eigvalsh(h)[-1]))
    w_star = torch.randn(dim, generator=g, dtype=torch.float64)
    b = a @ w_star + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    return a, b


def _loss(w, a, b) -> float:
    return float(0.5 * ((a @ w - b) ** 2).mean())


def _grad(w, a, b):
    # elementwise, not a.T @ r: a transposed BLAS call spins up threads, slow on 2 busy cores
    return ((a @ w - b)[:, None] * a).mean(0)


def delayed_sgd(delay: int, lr: float = 1.0, steps: int = 120,
                lr_rule: Callable[[float, int], float] | None = None) -> list[float]:
    """Simulation: full-batch gradient descent where each gradient is ``delay`` steps old.

    Args:
        delay: staleness ``k`` of every gradient (0: ordinary gradient descent).
        lr: the base learning rate (the problem's largest curvature is 1).
        lr_rule: ``lr_rule(lr, staleness) -> lr`` applied to every step (default: ``lr``).

    Returns the loss after every step (``inf`` once it overflows).
    """
    a, b = quadratic()
    w = torch.zeros(a.shape[1], dtype=torch.float64)
    history = [w.clone()]
    losses = []
    for t in range(steps):
        k = min(delay, t)            # the first steps have nothing older to use
        step_lr = lr if lr_rule is None else float(lr_rule(lr, k))
        w = w - step_lr * _grad(history[-1 - k], a, b)
        history.append(w.clone())
        del history[:-delay - 1]     # keep only what a delay of k needs
        loss = _loss(w, a, b)
        losses.append(loss if math.isfinite(loss) and loss < 1e12 else float("inf"))
        if losses[-1] == float("inf"):
            losses += [float("inf")] * (steps - t - 1)
            break
    return losses


def staleness_sweep(delays=(0, 1, 2, 4, 8, 16), lr: float = 1.0, steps: int = 120,
                    lr_rule=None) -> dict[int, list[float]]:
    """``delayed_sgd`` for several delays: the curves of the convergence-vs-staleness plot."""
    return {k: delayed_sgd(k, lr, steps, lr_rule) for k in delays}


# ------------------------------------------------------------ the real parameter server
@dataclass(repr=False)
class PSRun:
    """One parameter-server run: per update, who pushed it, its staleness, the loss after it."""

    mode: str
    world_size: int
    lr: float
    sources: list[int]
    staleness: list[int]
    losses: list[float]
    seconds: float

    def __repr__(self) -> str:
        return (f"PSRun(mode={self.mode!r}, {len(self.staleness)} updates from "
                f"{self.world_size - 1} workers, mean staleness {mean_staleness(self):.2f}, "
                f"max {max(self.staleness, default=0)}, final loss {self.losses[-1]:.4g}, "
                f"{self.seconds:.2f} s)")


def mean_staleness(ps: PSRun) -> float:
    """The average staleness of a run: how many updates behind each applied gradient was."""
    return sum(ps.staleness) / max(1, len(ps.staleness))


@scenario_fn
def _parameter_server_step(rank, world_size, updates=60, lr=0.9, mode="async", work_ms=3.0,
                           batch=32, seed=0):
    import time
    import torch.distributed as dist

    a, b = quadratic(seed=seed)
    if rank == 0:
        return _serve(world_size, updates, lr, mode, a, b)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    msg = torch.zeros(DIM + 2, dtype=torch.float64)       # weights, version, stop flag
    while True:
        dist.recv(msg, src=0)                              # pull
        if msg[-1] > 0:
            return "stopped"
        idx = torch.randint(len(b), (batch,), generator=g)
        grad = _grad(msg[:DIM], a[idx], b[idx])
        time.sleep(work_ms / 1000 * (0.5 + torch.rand(1, generator=g).item()))  # compute time
        dist.send(torch.cat([grad, msg[DIM:DIM + 1]]), dst=0)  # push, tagged with its version


def _serve(world_size, updates, lr, mode, a, b):
    import time
    import torch.distributed as dist

    workers = list(range(1, world_size))
    w, version = torch.zeros(DIM, dtype=torch.float64), 0
    sources, stale, losses = [], [], []
    t0 = time.perf_counter()

    def reply(dst, stop=False):
        dist.send(torch.cat([w, w.new_tensor([version, float(stop)])]), dst=dst)

    for r in workers:
        reply(r)
    buf = torch.zeros(DIM + 1, dtype=torch.float64)
    while version < updates:
        if mode == "sync":                                 # one round: every worker, same version
            grads = []
            for r in workers:
                dist.recv(buf, src=r)
                grads.append(buf[:DIM].clone())
            w = w - lr * torch.stack(grads).mean(0)
            version += 1
            sources.append(0)
            stale.append(0)
            losses.append(_loss(w, a, b))
            for r in workers:
                reply(r, stop=version >= updates)
            continue
        src = dist.recv(buf)                               # whichever worker pushes first
        s = version - int(buf[DIM])                        # updates since its weights
        step_lr = lr / max(1, s) if mode == "aware" else lr
        w = w - step_lr * buf[:DIM]
        version += 1
        sources.append(src)
        stale.append(s)
        losses.append(_loss(w, a, b))
        reply(src, stop=version >= updates)
    if mode != "sync":                                     # the others each have one push left
        for _ in workers[1:]:
            src = dist.recv(buf)
            reply(src, stop=True)
    return {"sources": sources, "staleness": stale, "losses": losses,
            "seconds": time.perf_counter() - t0}


def parameter_server(world_size: int = 4, mode: str = "async", updates: int = 60,
                     lr: float = 0.9, work_ms: float = 3.0, timeout: float = 5.0) -> PSRun:
    """Run a real parameter server (rank 0) with ``world_size - 1`` workers on gloo.

    Args:
        mode: ``"async"`` (push/pull without waiting), ``"aware"`` (async with
            ``lr / staleness``) or ``"sync"`` (every round waits for all workers).
        updates: how many updates the server applies.
        lr: base learning rate (the problem's largest curvature is 1).
        work_ms: a worker's mean compute time per gradient (slept, to be visible on 2 cores).
    """


    if mode not in ("async", "aware", "sync"):
        raise ValueError(f"mode must be 'async', 'aware' or 'sync', not {mode!r}")
    if world_size < 2:
        raise ValueError("a parameter server needs world_size >= 2 (one server, one worker or "
                         "more)")
    res = run(_parameter_server_step, world_size, kwargs=dict(updates=updates, lr=lr, mode=mode,
              work_ms=work_ms), timeout=timeout, backend="gloo", echo=False)
    out = res.values[0]
    return PSRun(mode, world_size, lr, out["sources"], out["staleness"], out["losses"],
                 out["seconds"])
