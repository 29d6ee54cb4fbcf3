"""Benchmark: how long until N ranks answer, against other launchers, measured on one clock.

``python -m labkit bench launch [--repeat 6] [--world-sizes 4]`` times one job on N gloo ranks
in four modes, each launcher in the same mode the same way:

* **cold, trivial** — a fresh Python process that runs one job (one ``all_reduce``) and exits,
  timed whole by this process (from starting it to its exit: interpreter, imports, launcher);
* **cold, DDP** — the same, the job one ``DistributedDataParallel`` training step (DDP's
  constructor and the optimizer import ``torch._dynamo``: ~1 s of CPU after ``import torch``);
* **first in a kernel** — a process does what a notebook's first cell does (``import labkit``,
  which in a kernel starts lk's launcher; ``import torch``), waits ``--settle`` seconds (a
  learner reading), then times its first job from the call;
* **repeated** — after that first job, the median of ``--jobs`` more (5), back to back, each
  from the call. The first jobs after the first run slower than later ones (cause not
  established; on the reference VM, three runs of 40 back-to-back lk jobs after the first:
  median of the first 5 2.2-2.8 ms, of the next 35 1.8-2.2 ms), so 5 read higher than the
  steady time. 5 by default, as in the README's tables (with ``--jobs 20`` accelerate's
  ``notebook_launcher`` once did not end within a run's limit, then 600 s).

Launchers: ``lk.run``; ``torch.multiprocessing.spawn`` (cold modes only: it cannot run a
function defined in a notebook cell); ``torch.multiprocessing.start_processes(...,
start_method="fork")``. Every peer's worker calls ``init_process_group`` (TCP, a free port)
and ``destroy_process_group`` around the job and sets one torch thread, as lk's ranks do. It
imports ``torch.distributed.nn`` before the group: else DDP's import of ``torch._dynamo`` keeps
the group alive and a rank's normal exit can abort in gloo's teardown
(:mod:`labkit.portable.ending`; lk's ranks end with ``os._exit``).
accelerate's ``notebook_launcher`` and ipyparallel join when installed (they are not the
lab's requirements); ipyparallel's engines, like lk's warm ranks, keep their group between
jobs, and its cluster is started in the first cell (kernel modes) or within the process (cold).
Repeats alternate the launchers' order (ABC, CBA, ...); each cell is the median (min-max) over
``--repeat`` runs, and ``lk / best`` divides lk's median by the best peer's.

It then reports the resident memory of a warm 4-rank pool (RSS counts pages shared between the
forked ranks once per rank; PSS shares them out fairly).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import procs

_SCRIPT = r'''
import os, socket, statistics, sys, time

def trivial(rank, world_size):
    import torch, torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()

def ddp(rank, world_size):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
    return 0.0

def _peer(rank, world_size, port, job):
    import torch, torch.distributed as dist
    import torch.distributed.nn   # before the group: else DDP's import keeps it alive at exit
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    globals()[job](rank, world_size)
    dist.destroy_process_group()

def _accel(job):   # accelerate's notebook_launcher runs this in each forked rank
    import torch, torch.distributed as dist
    import torch.distributed.nn
    from accelerate import PartialState
    torch.set_num_threads(1)
    state = PartialState(cpu=True)       # joins the group the launcher's environment describes
    globals()[job](state.process_index, state.num_processes)
    dist.destroy_process_group()

def _engine(rank, world_size, port, fn):   # ipyparallel runs this on each engine
    import torch, torch.distributed as dist
    import torch.distributed.nn
    if not dist.is_initialized():   # engines live on: the group too, as lk's warm ranks keep it
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    return fn(rank, world_size)

_cluster = {}

def _start_cluster(n):
    import ipyparallel as ipp
    _cluster["c"] = ipp.Cluster(n=n, log_level=40)
    _cluster["rc"] = _cluster["c"].start_and_connect_sync()
    _cluster["rc"].wait_for_engines(n)

def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def prepare(launcher, n):       # what a notebook's first cell does
    if launcher == "lk.run":
        import labkit
        labkit.warmup()         # what `import labkit` does inside a Jupyter kernel
    elif launcher == "ipyparallel":
        _start_cluster(n)       # its engines, started and connected
    import torch

def go(launcher, job, n):
    if launcher == "lk.run":
        import labkit
        labkit.run(globals()[job], world_size=n, echo=False)
    elif launcher == "accelerate":
        from accelerate import notebook_launcher
        notebook_launcher(_accel, args=(job,), num_processes=n, use_port=str(_port()))
    elif launcher == "ipyparallel":
        rc, port = _cluster["rc"], _port()
        pending = [rc[i].apply_async(_engine, i, n, port, globals()[job]) for i in range(n)]
        [p.get() for p in pending]
    else:
        import torch.multiprocessing as mp
        if launcher == "mp.spawn":
            mp.spawn(_peer, args=(n, _port(), job), nprocs=n)
        else:
            mp.start_processes(_peer, args=(n, _port(), job), nprocs=n, start_method="fork")

if __name__ == "__main__":
    launcher, mode, job, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "cold":
        if launcher == "ipyparallel":
            _start_cluster(n)
        go(launcher, job, n)
        if launcher == "ipyparallel":
            _cluster["c"].stop_cluster_sync()
    else:
        settle, jobs = float(sys.argv[5]), int(sys.argv[6])
        prepare(launcher, n)
        time.sleep(settle)
        t0 = time.perf_counter()
        go(launcher, job, n)
        first = time.perf_counter() - t0
        if mode == "kernel":
            print(first)
        else:
            times = []
            for _ in range(jobs):
                t0 = time.perf_counter()
                go(launcher, job, n)
                times.append(time.perf_counter() - t0)
            print(statistics.median(times))
        if launcher == "ipyparallel":
            _cluster["c"].stop_cluster_sync()
'''

LAUNCHERS = ("lk.run", "mp.spawn", "fork", "accelerate", "ipyparallel")
NOTEBOOK = ("lk.run", "fork", "accelerate", "ipyparallel")   # run a notebook's own function
MODES = {  # name: (script mode, job, launchers)
    "cold, trivial": ("cold", "trivial", LAUNCHERS),
    "cold, DDP": ("cold", "ddp", LAUNCHERS),
    "first in a kernel": ("kernel", "trivial", NOTEBOOK),
    "repeated": ("repeat", "trivial", NOTEBOOK),
}


def installed(launcher: str) -> bool:
    """accelerate and ipyparallel are not the lab's requirements: their rows need them installed."""
    import importlib.util

    module = {"accelerate": "accelerate", "ipyparallel": "ipyparallel"}.get(launcher)
    return module is None or importlib.util.find_spec(module) is not None


RUN_LIMIT_S = 180.0   # one run (a process), plus --settle; ipyparallel's take 13-25 s


class RunFailed(RuntimeError):
    """One run exited with an error, printed no time, or did not end within its limit."""


def _once(script: str, launcher: str, mode: str, job: str, n: int, settle: float,
          jobs: int) -> float:
    """One run in a fresh process: its whole time (cold) or the time it printed."""
    argv = [sys.executable, script, launcher, mode, job, str(n), str(settle), str(jobs)]
    limit = RUN_LIMIT_S + (settle if mode != "cold" else 0.0)
    t0 = time.perf_counter()
    try:
        code, out, err = procs.run("launch benchmark", argv, limit,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "LABKIT_PRESTART": "0"})
    except subprocess.TimeoutExpired:
        raise RunFailed(f"no end within {limit:g} s (stopped)") from None
    whole = time.perf_counter() - t0
    if code != 0:
        last = (err.strip().splitlines() or [""])[-1][-300:]
        raise RunFailed(f"exit status {code}" + (f": {last}" if last else ""))
    if mode == "cold":
        return whole
    try:
        return float(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RunFailed(f"printed no time: {out.strip()[-300:]!r}") from None


def measure(world_size: int, repeat: int = 6, settle: float = 5.0, jobs: int = 5,
            progress=None) -> list[dict]:
    """Every mode's row for ``world_size`` ranks: launcher -> list of seconds, and the runs
    that failed (a launcher that hangs or crashes once costs its run, not the table)."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "launch_bench.py")
        with open(script, "w") as f:
            f.write(_SCRIPT)
        for name, (mode, job, launchers) in MODES.items():
            launchers = tuple(lc for lc in launchers if installed(lc))
            times: dict[str, list[float]] = {lc: [] for lc in launchers}
            failed: dict[str, list[str]] = {}
            for r in range(repeat):
                for lc in launchers if r % 2 == 0 else launchers[::-1]:
                    try:
                        times[lc].append(_once(script, lc, mode, job, world_size, settle, jobs))
                        said = f"{times[lc][-1]:.3f} s"
                    except RunFailed as exc:
                        failed.setdefault(lc, []).append(str(exc))
                        said = f"failed: {exc}"
                    if progress:
                        progress(f"{world_size} ranks, {name}, {lc}: {said}")
            rows.append({"ranks": world_size, "mode": name, "times": times, "failed": failed})
    return rows


def _cell(lc: str):
    def show(row: dict) -> str:
        t = row["times"].get(lc)
        if not t:
            return "-"
        return f"{_s(statistics.median(t))} ({_s(min(t))}-{_s(max(t))})"
    return show


def _s(seconds: float) -> str:
    """Three decimals, four below 0.1 s: a repeated job's milliseconds keep two digits."""
    return f"{seconds:.4f}" if seconds < 0.1 else f"{seconds:.3f}"


def _ratio(row: dict) -> str:
    med = {lc: statistics.median(t) for lc, t in row["times"].items() if t}
    peers = [v for lc, v in med.items() if lc != "lk.run"]
    if "lk.run" not in med or not peers:
        return "-"
    return f"{med['lk.run'] / min(peers):.2f}x"


def launch_table(rows: list[dict], repeat: int, settle: float, jobs: int) -> str:
    """The table (written here: the runtime sits below ``common.tables`` in the layers)."""
    launchers = [lc for lc in LAUNCHERS if installed(lc)]
    head = [f"{'ranks':>5}", f"{'mode':<18}", *(f"{lc + ' s':>25}" for lc in launchers),
            f"{'lk / best':>9}"]
    lines = [f"seconds, median (min-max) of {repeat} runs, launchers' order alternating; cold: "
             f"a fresh process timed whole by its parent; first in a kernel: after the first "
             f"cell's imports and {settle:g} s; repeated: median of {jobs} more jobs; '-': no "
             f"run (mp.spawn cannot run a notebook's function; or every run failed, see below)"]
    lines += [f"{lc}: not installed here, so no column (pip install {lc} to add it)"
              for lc in LAUNCHERS if not installed(lc)]
    lines.append(" ".join(head))
    for r in rows:
        lines.append(" ".join([f"{r['ranks']:>5}", f"{r['mode']:<18}",
                               *(f"{_cell(lc)(r):>25}" for lc in launchers), f"{_ratio(r):>9}"]))
    for r in rows:
        for lc, why in r.get("failed", {}).items():
            lines.append(f"{r['ranks']} ranks, {r['mode']}, {lc}: {len(why)} of {repeat} runs "
                         f"failed, left out of its cell ({why[0]})")
    return "\n".join(lines)


def _pool_memory(n: int = 4) -> dict:
    import psutil

    from .launch import run

    run(lambda rank, world_size: None, world_size=n, echo=False)
    rss = pss = 0
    found = [p for z in psutil.Process().children() for p in [z, *z.children()]]
    ranks = sum(1 for z in psutil.Process().children() for _ in z.children())
    for p in found:
        m = p.memory_full_info()
        rss, pss = rss + m.rss, pss + m.pss
    return {"ranks": ranks, "processes": len(found), "rss_mb": rss / 2**20, "pss_mb": pss / 2**20}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit bench launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=6, help="runs per launcher and mode")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[4])
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds between the first cell and the first job (kernel modes)")
    ap.add_argument("--jobs", type=int, default=5, help="jobs timed in the repeated mode")
    ap.add_argument("--json", help="also write the numbers to this file")
    opts = ap.parse_args(argv)
    show = (lambda line: print(line, file=sys.stderr, flush=True)) if sys.stderr.isatty() else None
    rows = [r for n in opts.world_sizes
            for r in measure(n, opts.repeat, opts.settle, opts.jobs, progress=show)]
    print(f"python -m labkit bench launch: {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print(launch_table(rows, opts.repeat, opts.settle, opts.jobs))
    mem = _pool_memory(4)
    print(f"\nWarm pool of {mem['ranks']} ranks + launcher ({mem['processes']} processes): "
          f"RSS {mem['rss_mb']:.0f} MB summed, PSS {mem['pss_mb']:.0f} MB (target < 1500 MB)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"latency": rows, "memory": mem}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
