"""The cost of every collective: measured on gloo against its α–β formula (notebook 07 §6).

One table for the collectives the lab uses: the all-reduce of DDP and notebook 03's ring, and
the reduce-scatter, all-gather and broadcast of notebook 06's ZeRO/FSDP (all-gather in forward
and backward, reduce-scatter of the gradients), plus all-to-all (expert parallelism). S is the
payload in bytes as nccl-tests counts it (NVIDIA/nccl-tests: doc/PERFORMANCE.md): the whole
tensor reduced or broadcast, the *gathered* output of an all-gather, the *input* of a
reduce-scatter, the input of an all-to-all.

The α–β formulas of the bandwidth-optimal algorithms, for n ranks (α: time per step, β: time
per byte on one link)::

    all-reduce       2(n-1)·α + 2(n-1)/n · S·β      (ring: reduce-scatter + all-gather)
    reduce-scatter    (n-1)·α +  (n-1)/n · S·β
    all-gather        (n-1)·α +  (n-1)/n · S·β
    all-to-all        (n-1)·α +  (n-1)/n · S·β      (pairwise exchange)
    broadcast         (n-1)·α +          S·β        (pipelined chain, large S)

and nccl-tests' bus bandwidth, busbw = algbw · factor, with algbw = S / time: the factor is
2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter, all-gather and all-to-all, 1 for
broadcast. busbw is what each link carried per second, so a collective that reaches the link's
speed shows the same busbw whatever it is and however many ranks run it.

:func:`measure_costs` times each on real ranks (barrier, slowest rank, median); :func:`fit_link`
fits one α and β per world size to the all-reduce rows; :func:`cost_rows` predicts every other
collective from them, so the ratio column says how far gloo's implementation is from the
bandwidth-optimal one on this machine. Gloo's own algorithms are not necessarily these.

Example::

    costs = lk.scaling.measure_costs(sizes=(2**16, 2**20), world_sizes=(2, 4))
    print(lk.scaling.cost_table(costs))
"""
from __future__ import annotations

import statistics

from ..collectives.bandwidth import fit_alpha_beta, fmt_bytes, link_text
from ..common.progress import progress as progress_bar
from ..common.tables import Col, table
from ..runtime import run
from .timing import JOB_DEADLINE, slowest_runs

__all__ = ["COLLECTIVES", "BUSBW_FACTOR", "model_time", "busbw_factor", "measure_costs",
           "fit_link", "cost_rows", "cost_table"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
# (steps, bytes on the busiest link / S) of the bandwidth-optimal algorithm, as functions of n
_SHAPE = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: n - 1, lambda n: 1.0),
}
BUSBW_FACTOR = {"all_reduce": "2(n-1)/n", "reduce_scatter": "(n-1)/n", "all_gather": "(n-1)/n",
                "all_to_all": "(n-1)/n", "broadcast": "1"}


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``collective`` on ``n`` ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(collective, (n - 1) / n)


def model_time(collective: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """α–β time of ``collective`` moving payload S = ``nbytes`` on ``n`` ranks (a MODEL)."""
    if collective not in _SHAPE:
        raise ValueError(f"unknown collective {collective!r}; choose from {COLLECTIVES}.")
    steps, per_link = _SHAPE[collective]
    return steps(n) * alpha + per_link(n) * nbytes * beta


def _cost_rank(rank, world_size, sizes, collectives, iters):
    import time

    import torch
    import torch.distributed as dist

    n = world_size
    out = {}
    for s in sizes:
        k = max(1, s // 4 // n) * n                        # float32 elements, divisible by n
        full, part = torch.ones(k), torch.ones(k // n)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
               "all_gather": lambda: dist.all_gather_single(full, part),
               "broadcast": lambda: dist.broadcast(full, src=0),
               "all_to_all": lambda: dist.all_to_all_single(full.clone(), full)}
        for c in collectives:
            times = []
            for i in range(iters + 1):                     # the first one warms up
                dist.barrier()
                t0 = time.perf_counter()
                ops[c]()
                if i:
                    times.append(time.perf_counter() - t0)
            out[(c, k * 4)] = times
    return out


def measure_costs(sizes=(2 ** 16, 2 ** 20), world_sizes=(2, 4), collectives=COLLECTIVES,
                  iters: int = 5, progress: bool = True) -> list[dict]:
    """Time each collective for each payload size (bytes) and world size on real ranks.

    Rows ``{collective, world_size, bytes, time_s (median of the slowest rank), runs,
    algbw, busbw (GB/s)}``.
    """
    rows = []
    bar = progress_bar(total=len(world_sizes), show=progress, desc="collectives", unit="job")
    for n in world_sizes:
        res = run(_cost_rank, n, args=(tuple(sizes), tuple(collectives), iters), deadline=JOB_DEADLINE,
                  echo=False)
        for (c, nbytes), _ in res.values[0].items():
            per_run = slowest_runs([v[(c, nbytes)] for v in res.values])
            t = statistics.median(per_run)
            algbw = nbytes / t / 1e9
            rows.append(dict(collective=c, world_size=n, bytes=nbytes, time_s=t, runs=iters,
                             algbw=algbw, busbw=algbw * busbw_factor(c, n)))
        bar.update(1)
    bar.close()
    return rows


def fit_link(rows: list[dict], collective: str = "all_reduce") -> dict[int, dict]:
    """α and β per world size from ``collective``'s rows (every size measured), with what the
    points resolve (:func:`labkit.collectives.bandwidth.fit_alpha_beta`): ``{n: fit}``."""
    out = {}
    for n in sorted({r["world_size"] for r in rows}):
        pts = [(r["bytes"], r["time_s"]) for r in rows
               if r["collective"] == collective and r["world_size"] == n]
        if len(pts) < 2:
            raise ValueError(f"fitting α and β needs {collective} at 2 sizes or more on {n} "
                             f"ranks; got {len(pts)}.")
        out[n] = fit_alpha_beta((model_time(collective, s, n, 1.0, 0.0),
                                 model_time(collective, s, n, 0.0, 1.0), t) for s, t in pts)
    return out


def cost_rows(rows: list[dict], link: dict[int, dict] | None = None) -> list[dict]:
    """``rows`` with ``model_s`` (from the α–β fit of the all-reduce) and ``ratio`` =
    measured / model added."""
    link = link or fit_link(rows)
    out = []
    for r in rows:
        f = link[r["world_size"]]
        m = model_time(r["collective"], r["bytes"], r["world_size"], f["alpha"], f["beta"])
        out.append({**r, "model_s": m, "ratio": r["time_s"] / m if m else float("nan")})
    return out


def cost_table(rows: list[dict]) -> str:
    """Measured vs model for every row, with algbw/busbw (nccl-tests conventions)."""
    link = fit_link(rows)
    above = ["each collective on gloo: median of the slowest rank; model = alpha-beta formula "
             "with alpha, beta fitted to this world size's all-reduce (a MODEL)"]
    above += [f"  {n} ranks: alpha = {f['alpha'] * 1e6:.0f} us/step"
              + (" (clipped at 0)" if f["alpha_clipped"] else "") + f", {link_text(f)}"
              for n, f in link.items()]
    if not all(f["resolved"] for f in link.values()):
        above.append("  where 1/beta is not resolved the model keeps a beta the points do not pin "
                      "down, so its 'x model' column says little")
    return table([Col("collective", "collective", "<15"), Col("ranks", "world_size", ">5"),
                  Col("S", lambda r: fmt_bytes(r["bytes"]), ">8"),
                  Col("measured ms", lambda r: r["time_s"] * 1e3, ">12.3f"),
                  Col("model ms", lambda r: r["model_s"] * 1e3, ">9.3f"),
                  Col("x model", "ratio", ">8.2f"), Col("algbw GB/s", "algbw", ">11.3f"),
                  Col("busbw GB/s", "busbw", ">11.3f"),
                  Col("busbw factor", lambda r: BUSBW_FACTOR[r["collective"]])],
                 cost_rows(rows, link), above=above)
