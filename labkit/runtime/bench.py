"""Benchmark: how long until N ranks answer, and what a warm pool costs in memory.

``python -m labkit bench launch [--repeat 3]`` prints, for 2 and 4 ranks, the
time from the call to the result of one gloo ``all_reduce`` job:

* ``mp.spawn``: plain ``torch.multiprocessing.spawn`` of a module-level function
  (a notebook function cannot be spawned at all), parent with torch imported;
* ``lk.run cold``: a fresh interpreter, nothing started before the call;
* ``lk.run first (kernel)``: what a notebook sees: the kernel imported labkit
  (which starts the launcher) and torch in its first cell, then runs the job;
* ``lk.run warm``: the median of repeated jobs on warm ranks.

Every cold number comes from a new Python process, median of ``--repeat`` runs.
It then reports the resident memory of a warm 4-rank pool (RSS counts pages
shared between the forked ranks once per rank; PSS shares them out fairly).
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

_STEP = '''
def step(rank, world_size):
    import torch, torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()
'''

_SPAWN = _STEP + '''
def worker(rank, world_size, port):
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    step(rank, world_size)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket, sys, time
    import torch, torch.multiprocessing as mp
    n = int(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.spawn(worker, args=(n, port), nprocs=n)
    print(time.perf_counter() - t0)
'''

_COLD = _STEP + '''
import sys, time
import labkit as lk
n, mode = int(sys.argv[1]), sys.argv[2]
if mode == "kernel":
    lk.warmup()           # what `import labkit` does inside a Jupyter kernel
    import torch          # the notebook's own first cell
t0 = time.perf_counter()
lk.run(step, world_size=n, echo=False)
print(time.perf_counter() - t0)
'''


def _python(script: str, *args: str) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench_script.py")
        with open(path, "w") as f:
            f.write(script)
        code, out, err = procs.run("benchmark script", [sys.executable, path, *args], 300,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "LABKIT_PRESTART": "0"})
    if code != 0:
        raise RuntimeError(f"benchmark subprocess failed:\n{err[-2000:]}")
    return float(out.strip().splitlines()[-1])


def _warm(n: int, repeat: int = 30) -> float:
    from .launch import run

    ns: dict = {}
    exec(_STEP, ns)
    run(ns["step"], world_size=n, echo=False)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run(ns["step"], world_size=n, echo=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pool_memory(n: int = 4) -> dict:
    import psutil

    from .launch import run

    run(lambda rank, world_size: None, world_size=n, echo=False)
    rss = pss = 0
    procs = [p for z in psutil.Process().children() for p in [z, *z.children()]]
    ranks = sum(1 for z in psutil.Process().children() for _ in z.children())
    for p in procs:
        m = p.memory_full_info()
        rss, pss = rss + m.rss, pss + m.pss
    return {"ranks": ranks, "processes": len(procs), "rss_mb": rss / 2**20, "pss_mb": pss / 2**20}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit bench launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per cold number")
    ap.add_argument("--json", help="also write the numbers to this file")
    opts = ap.parse_args(argv)
    rows = []
    for n in (2, 4):
        med = lambda *a: statistics.median(_python(*a) for _ in range(opts.repeat))  # noqa: E731
        rows.append({"ranks": n, "mp.spawn": med(_SPAWN, str(n)),
                     "lk.run cold": med(_COLD, str(n), "cold"),
                     "lk.run first (kernel)": med(_COLD, str(n), "kernel"),
                     "lk.run warm": _warm(n)})
    mem = _pool_memory(4)
    cols = list(rows[0])
    print(f"Launch latency, one gloo all_reduce job, seconds (median; cold: {opts.repeat} fresh "
          f"processes each; {os.cpu_count()} cores)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) if c == "ranks" else f"{r[c]:.3f}" for c in cols) + " |")
    print(f"\nWarm pool of {mem['ranks']} ranks + launcher ({mem['processes']} processes): "
          f"RSS {mem['rss_mb']:.0f} MB summed, PSS {mem['pss_mb']:.0f} MB (target < 1500 MB)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"latency": rows, "memory": mem}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
