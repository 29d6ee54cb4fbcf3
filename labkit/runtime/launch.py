"""Launching ranks: run a function written in a notebook cell on N real processes.

``mp.spawn`` of a notebook function fails (children look it up by name in an
unimportable ``__main__``) and takes seconds. :func:`run` ships the function
by value (cloudpickle) to ranks forked from a preloaded zygote
(:mod:`labkit.runtime.zygote`), each with a real ``torch.distributed`` process
group, and keeps them warm between jobs. Any failure — an exception,
``os._exit``, a signal, a hang — comes back as a
:class:`~labkit.runtime.errors.JobFailed` naming the rank, and every rank of
that job is gone before the error is raised. So it is for Ctrl-C (the notebook's stop button),
at any moment of a job: ``KeyboardInterrupt`` comes at once, never lost
(:class:`~labkit.runtime.pool.Interrupts`).

Where it runs: Linux (what the lab is built and tested on). The runner forks ranks from a
preloaded launcher and asks Linux's ``prctl(PR_SET_PDEATHSIG)`` to take them down with the
kernel; macOS (Python's docs call fork without exec unsafe there: bpo-33725; no parent-death
signal) and native Windows (no fork at all) are refused at once with
:class:`UnsupportedPlatform`, which names the way out (WSL2 on Windows, Linux elsewhere).
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from .errors import BackendUnavailable, InvalidJob, UnsupportedPlatform, error_for
from .pickling import pickle_job
from .pool import Interrupts, Pool, Zygote
from .preload import needs_dynamo
from .protocol import PoolSpec
from .result import JobResult

__all__ = ["run", "warmup", "shutdown", "check_platform", "MAX_WORLD_SIZE",
           "BACKENDS", "SUPPORTED_PLATFORMS"]

MAX_WORLD_SIZE = int(os.environ.get("LABKIT_MAX_WORLD_SIZE", "32"))
BACKENDS = ("auto", "gloo", "nccl")
DEVICE_MAPPED = "cpu:gloo,cuda:nccl"        # what "nccl" (and "auto" with the GPUs) runs
_IDLE_S = float(os.environ.get("LABKIT_IDLE_TIMEOUT", "600"))

_lock = threading.RLock()
SUPPORTED_PLATFORMS = ("linux",)
_zygotes: OrderedDict[tuple, Zygote] = OrderedDict()  # at most 2, by job env
_pool: Pool | None = None


def run(fn: Callable[..., Any], world_size: int = 2, *, args: tuple = (),
        kwargs: dict | None = None, backend: str = "auto", timeout: float = 30.0,
        deadline: float | None = None, env: dict[str, str] | None = None,
        threads: int = 1, check: bool = True, echo: bool = True,
        fresh: bool = False, trace: bool = False) -> JobResult:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` real ranks.

    Each rank is its own process with the default process group initialised
    (``torch.distributed`` is ready: call ``dist.all_reduce`` straight away).

    Args:
        fn: any callable, including one defined in a notebook cell, a closure or a lambda.
        world_size: number of ranks (processes), 1 to ``MAX_WORLD_SIZE``.
        args, kwargs: passed through to ``fn`` after ``rank, world_size``.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``"auto"`` (like
            ``"nccl"`` when there are at least ``world_size`` GPUs, else gloo). "nccl" starts a
            device-mapped group, ``"cpu:gloo,cuda:nccl"``: CUDA tensors use NCCL, CPU tensors
            gloo (``JobResult.backend`` says which ran).
        timeout: process-group timeout in seconds: a collective waiting longer raises.
        deadline: wall-clock limit of the job in seconds (default ``timeout + 3``);
            ranks still running then are stack-dumped and killed (:class:`JobTimeout`).
        env: extra environment variables for the ranks, e.g.
            ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``; these get fresh processes.
        threads: ``torch.set_num_threads`` in every rank (1: right for small CPU work).
        check: raise :class:`JobFailed` when a rank fails (else return the result).
        echo: print each rank's output in rank order after the job.
        fresh: start new rank processes even if a warm pool matches.
        trace: record every collective and point-to-point op of every rank
            (:mod:`labkit.runtime.commtrace`), returned as ``result.trace``; ``fn`` is not
            changed. It slows the ranks' compute while on; off (the default) installs nothing.

    Returns:
        :class:`JobResult` with per-rank ``values``, ``stdout``, ``stderr``, ``wall_s``
        (and ``trace`` when asked for).

    Example::

        def step(rank, world_size):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            return t.item()

        lk.run(step, world_size=4).values   # [10.0, 10.0, 10.0, 10.0]
    """
    check_platform()
    kwargs = dict(kwargs or {})
    env = _check_job(fn, world_size, args, kwargs, backend, timeout, deadline, env, threads)
    if not isinstance(trace, bool):
        raise InvalidJob(f"trace must be True or False, got {trace!r}. trace=True records every "
                         f"collective of every rank (result.trace).")
    t0 = time.perf_counter()
    if backend == "nccl":  # refuse before anything starts
        _resolve_backend(backend, world_size, None)
    with Interrupts.watch() as interrupts:  # Ctrl-C ends any wait below at once
        with Interrupts.immediate():
            payload = pickle_job(fn, args, kwargs)
            dynamo = needs_dynamo(fn, args, kwargs)
        with _lock:
            zygote = _zygote_for(env)               # starts importing torch in the background
            backend = _resolve_backend(backend, world_size, zygote)
            spec = PoolSpec(world_size=world_size, backend=backend, timeout=float(timeout),
                            threads=threads, idle_timeout=_IDLE_S)
            pool, cold = _pool_for(zygote, spec, fresh, dynamo)
            try:
                result = pool.run_job(payload, timeout + 3.0 if deadline is None else deadline,
                                      trace=trace)
                interrupts.check()  # one that came after the last wait (or in a finaliser)
            except BaseException:  # KeyboardInterrupt included: no rank outlives its job
                _drop_pool()
                raise
            if not (result.ok and pool.healthy):
                _drop_pool()
    result.elapsed_s, result.cold, result.env = time.perf_counter() - t0, cold, env
    if echo:
        _echo(result)
    if check and not result.ok:
        raise error_for(result)
    return result


def warmup() -> None:
    """Start the rank launcher now, in the background, so the first job starts fast.

    Importing labkit in a Jupyter kernel does this already; it returns at once.
    """
    check_platform()
    with _lock:
        _zygote_for({})


def check_platform(platform: str | None = None) -> None:
    """Refuse, at once and with the way out, an operating system the runner cannot serve."""
    platform = sys.platform if platform is None else platform
    if platform.startswith(SUPPORTED_PLATFORMS):
        return
    if platform.startswith(("win32", "cygwin", "msys")):
        way_out = ("Windows has no fork(), which the runner needs. Run the lab inside WSL2 "
                   "(Windows Subsystem for Linux: `wsl --install`, then follow the README's "
                   "quickstart in the Ubuntu shell).")
    elif platform == "darwin":
        way_out = ("The runner forks ranks from a process that has imported torch, which "
                   "Python's documentation calls unsafe on macOS (system libraries may start "
                   "threads; bpo-33725), and it needs Linux's parent-death signal so that no "
                   "rank outlives the kernel. Run the lab on a Linux machine, VM or container.")
    else:
        way_out = "Run the lab on Linux (a machine, a VM or a container)."
    raise UnsupportedPlatform(f"lk.run cannot run ranks on this platform ({platform!r}): it is "
                              f"built and tested on Linux only. {way_out}")


def shutdown() -> None:
    """Stop the warm ranks and the zygotes now (they also stop when idle, and at exit:
    :func:`labkit.runtime.procs.stop_all`)."""
    with _lock:
        _drop_pool()
        while _zygotes:
            _zygotes.popitem()[1].close()


# --------------------------------------------------------------- validation
def _check_job(fn, world_size, args, kwargs, backend, timeout, deadline, env, threads) -> dict:
    if not callable(fn):
        raise InvalidJob(f"lk.run needs a function to run on every rank, got {type(fn).__name__} "
                         f"{fn!r:.80}. Define `def step(rank, world_size): ...` and pass `step`.")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InvalidJob(f"world_size must be a whole number of ranks, got {world_size!r}.")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidJob(
            f"world_size={world_size} is outside 1..{MAX_WORLD_SIZE}: each rank is a process with "
            f"its own copy of torch, and this machine has {os.cpu_count()} cores. Use 2-4 ranks "
            f"(set LABKIT_MAX_WORLD_SIZE to raise the cap on a bigger machine).")
    if backend not in BACKENDS:
        raise InvalidJob(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} "
                         f"('gloo' runs on CPU, 'nccl' needs one GPU per rank).")
    for name, value in (("timeout", timeout), ("deadline", deadline)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            raise InvalidJob(f"{name} must be a positive number of seconds, got {value!r}.")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidJob(f"threads must be a positive whole number, got {threads!r}.")
    if not isinstance(args, (tuple, list)):
        raise InvalidJob(f"args must be a tuple of positional arguments, got {type(args).__name__}."
                         f" For one argument write args=(x,).")
    env = dict(env or {})
    bad = [k for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise InvalidJob(f"env values must be strings (environment variables), not {bad[:3]}.")
    try:
        inspect.signature(fn).bind(0, world_size, *args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__name__", repr(fn))
        raise InvalidJob(f"{name} cannot be called as {name}(rank, world_size, *args, **kwargs): "
                         f"{exc}. Every rank calls it with its rank and the world size first.") \
            from None
    except ValueError:  # builtins without a signature: let the ranks try
        pass
    return env


def _gpu_count(zygote) -> int:
    """GPUs visible here, without importing torch in the notebook just to ask."""
    if zygote is None or "torch" in sys.modules:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return zygote.gpu_count()


def _resolve_backend(backend: str, world_size: int, zygote) -> str:
    """What ``init_process_group`` gets. With one GPU per rank ("auto" or "nccl") a device-mapped
    group, :data:`DEVICE_MAPPED`: CUDA tensors go through NCCL, CPU tensors through gloo, so a
    lesson cell that all-reduces a CPU tensor or wraps a CPU module in DDP works on a GPU box
    too, and one that puts its tensors on ``lk.ddp.device()`` runs on NCCL."""
    if backend == "gloo":
        return backend
    gpus = _gpu_count(zygote)
    if backend == "auto":
        return DEVICE_MAPPED if gpus >= world_size else "gloo"
    if gpus < world_size:
        raise BackendUnavailable(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine has "
            f"{gpus} GPU{'s' * (gpus != 1)}. Use backend='gloo' (CPU) or backend='auto'.")
    return DEVICE_MAPPED


# ----------------------------------------------------------- process cache
def _zygote_for(env: dict) -> Zygote:
    key = tuple(sorted(env.items()))
    z = _zygotes.pop(key, None)
    if z is None or not z.alive():
        if z is not None:
            if _pool is not None and _pool.zygote is z:
                _drop_pool()
            z.close()
        z = Zygote(env)
    _zygotes[key] = z
    while len(_zygotes) > 2:
        old_key, old = _zygotes.popitem(last=False)
        if _pool is not None and _pool.zygote is old:
            _drop_pool()
        old.close()
    return z


def _pool_for(zygote, spec: PoolSpec, fresh: bool, dynamo: bool):
    global _pool
    if _pool is not None and (fresh or not _pool.reusable(zygote, spec, dynamo)):
        _drop_pool()
    if _pool is not None:
        return _pool, False
    # A start that fails or is interrupted kills its ranks (Pool, Zygote.fork); a zygote that
    # failed is closed, and the next _zygote_for replaces it.
    _pool = Pool(zygote, spec, dynamo)
    return _pool, True


def _drop_pool() -> None:
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        pool.kill()


def _echo(result: JobResult) -> None:
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        for r in result.ranks:
            text = getattr(r, name)
            if text:
                lines = text.rstrip("\n").split("\n")
                stream.write("".join(f"[rank {r.rank}] {ln}\n" for ln in lines))
        stream.flush()
