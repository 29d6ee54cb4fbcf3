"""Collective failures on real ranks: hangs, mismatches, silent wrong sums, crashes (notebook 04).

Every collective must be called by every rank of the group, in the same order,
with the same sizes. Each scenario below breaks one of those rules on real
gloo ranks, with a process-group timeout of seconds, and returns an
:class:`~labkit.pitfalls.Outcome` whose verdict tests/pitfalls/test_pitfalls.py asserts:

=====================  ==================================================  =================
runner                 what goes wrong                                      verdict kind
=====================  ==================================================  =================
late_rank              one rank is busy elsewhere: the others time out      missing_rank
skipped_collective     ``if rank != 1: dist.all_reduce(t)``                  missing_rank
missing_ranks          ``monitored_barrier(wait_all_ranks=True)`` names them missing_rank
mismatched             all_reduce on rank 0, broadcast on the others         mismatch
collective_under_if    a logging all_reduce only on rank 0, then a barrier   mismatch
extra_all_reduce       same-shape extra all_reduce: wrong numbers, then hang missing_rank
swapped_order          gradients all-reduced in a different order: silent    replicas_diverged
size_mismatch          different sizes or dtypes: gloo aborts (SIGABRT)      size_mismatch
crashed_rank           a rank dies; survivors see the connection close       crash / error
flight_recorder        the flight recorder shows who stopped, and where      missing_rank
mystery                a hang to diagnose from the ranks' stacks (exercise)  missing_rank
=====================  ==================================================  =================

``detail=True`` runs a scenario with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which
checks every collective's fingerprint across ranks first (fresh processes).
"""
from __future__ import annotations

from ..common.ranks import device
from ..diagnosis import fingerprint, flight_record
from ..runtime import JobResult, run
from .scenario import Outcome, scenario, scenario_fn

__all__ = ["late_rank", "skipped_collective", "missing_ranks", "mismatched",
           "collective_under_if", "extra_all_reduce", "swapped_order", "size_mismatch",
           "crashed_rank", "flight_recorder", "mystery", "nccl_watchdog", "DETAIL", "FR_ENV",
           "NCCL_ENV"]

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "64"}


# ------------------------------------------------------------ a rank never arrives
@scenario_fn
def _late_rank_step(rank, world_size, late=1, late_s=60.0):
    import time
    import torch
    import torch.distributed as dist

    t = torch.ones(3, device=device())
    if rank == late:
        time.sleep(late_s)            # BUG: this rank is busy elsewhere (data loading, a bug...)
    dist.all_reduce(t)                # the others wait here until the timeout
    return t.tolist()


def late_rank(world_size: int = 2, late: int = 1, late_s: float = 60.0,
              timeout: float = 2.0) -> Outcome:
    """Rank ``late`` arrives ``late_s`` seconds late; with ``late_s < timeout`` the job is fine."""
    return scenario("late_rank", _late_rank_step, world_size, timeout=timeout, late=late,
                    late_s=late_s)


@scenario_fn
def _skipped_collective_step(rank, world_size, skipper=1, fixed=False):
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(rank + 1), device=device())
    if fixed or rank != skipper:      # BUG: a collective under an `if` (FIX: call it everywhere)
        dist.all_reduce(t)
    return t.tolist()


def skipped_collective(world_size: int = 2, skipper: int = 1, fixed: bool = False,
                       timeout: float = 2.0) -> Outcome:
    """Rank ``skipper`` skips the all_reduce and returns; the others time out."""
    return scenario("skipped_collective", _skipped_collective_step, world_size, timeout=timeout,
                    skipper=skipper, fixed=fixed)


@scenario_fn
def _missing_ranks_step(rank, world_size, missing=(2, 3), barrier_s=2.0, fixed=False):
    import datetime
    import time
    import torch.distributed as dist

    if rank in missing and not fixed:
        time.sleep(60)                # BUG: these ranks never arrive
    # gloo only: rank 0 waits for everyone, then names every rank that did not arrive
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_s), wait_all_ranks=True)
    return "passed"


def missing_ranks(world_size: int = 4, missing: tuple = (2, 3), fixed: bool = False,
                  barrier_s: float = 2.0) -> Outcome:
    """``monitored_barrier(wait_all_ranks=True)`` on rank 0 names the ranks that never came."""
    return scenario("missing_ranks", _missing_ranks_step, world_size, timeout=barrier_s + 3,
                    missing=tuple(missing), barrier_s=barrier_s, fixed=fixed)


# ------------------------------------------------------------ ranks disagree on the collective
@scenario_fn
def _mismatched_step(rank, world_size, fixed=False):
    import torch
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1), device=device())
    if rank == 0 or fixed:
        dist.all_reduce(t)            # rank 0 sums...
    else:
        dist.broadcast(t, src=0)      # BUG: ...while the others wait for a broadcast
    return t.tolist()


def mismatched(world_size: int = 2, detail: bool = False, fixed: bool = False,
               timeout: float = 2.0) -> Outcome:
    """all_reduce vs broadcast: a timeout, or with ``detail=True`` (DETAIL) an immediate error."""
    return scenario("mismatched", _mismatched_step, world_size, timeout=timeout,
                    env=DETAIL if detail else None, fixed=fixed)


@scenario_fn
def _collective_under_if_step(rank, world_size, fixed=False):
    import torch
    import torch.distributed as dist

    loss = torch.tensor([float(rank + 1)], device=device())
    if rank == 0 or fixed:            # BUG: "only rank 0 logs", so only rank 0 all-reduces
        dist.all_reduce(loss)         # (FIX: every rank joins, rank 0 alone prints)
    dist.barrier()                    # end of step: the others are already here
    return loss.item() / world_size


def collective_under_if(world_size: int = 2, detail: bool = False, fixed: bool = False,
                        timeout: float = 2.0) -> Outcome:
    """A metric all-reduced only on rank 0 meets the others' barrier."""
    return scenario("collective_under_if", _collective_under_if_step, world_size,
                    timeout=timeout, env=DETAIL if detail else None, fixed=fixed)


@scenario_fn
def _extra_all_reduce_step(rank, world_size, fixed=False):
    import torch
    import torch.distributed as dist

    metric = torch.full((4,), float(rank + 1), device=device())
    grad = torch.full((4,), 10.0 * (rank + 1), device=device())
    if rank == 0 or fixed:
        dist.all_reduce(metric)       # BUG: an extra all_reduce on rank 0 only, same shape
    dist.all_reduce(grad)             # rank 1's grad is summed with rank 0's metric
    return {"grad": grad.tolist(), "expected": [10.0 * world_size * (world_size + 1) / 2] * 4}


def extra_all_reduce(world_size: int = 2, fixed: bool = False, timeout: float = 2.0) -> Outcome:
    """Rank 1 silently returns a wrong sum; rank 0 then waits for a partner that never comes."""
    return scenario("extra_all_reduce", _extra_all_reduce_step, world_size, timeout=timeout,
                    fixed=fixed)


@scenario_fn
def _swapped_order_step(rank, world_size, steps=3, fixed=False):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)              # same initial weights everywhere
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    model = torch.nn.Sequential(*layers).to(device())
    torch.manual_seed(100 + rank)     # each rank's own data
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(8, 4, device=device())).pow(2).mean().backward()
        order = layers[::-1] if (rank % 2 and not fixed) else layers  # BUG: another layer order
        for layer in order:           # e.g. a dict built differently; same shapes pair up:
            for p in layer.parameters():  # no error, but rank 0's layer 0 + rank 1's layer 1
                dist.all_reduce(p.grad)
                p.grad /= world_size
        with torch.no_grad():         # the SGD step, by hand
            for p in model.parameters():
                p -= 0.1 * p.grad
    return fingerprint(model)


def swapped_order(world_size: int = 2, fixed: bool = False, detail: bool = False,
                  steps: int = 3) -> Outcome:
    """Gradients all-reduced in a different order on odd ranks: no error, replicas diverge."""
    return scenario("swapped_order", _swapped_order_step, world_size, timeout=5.0,
                    env=DETAIL if detail else None, steps=steps, fixed=fixed)


# ------------------------------------------------------------ a rank dies
@scenario_fn
def _size_mismatch_step(rank, world_size, dtype=False, fixed=False):
    import torch
    import torch.distributed as dist

    n = 4 if (rank == 0 or dtype or fixed) else 5          # BUG (size): rank 1 has 5 elements
    kind = torch.float64 if (dtype and rank == 1 and not fixed) else torch.float32  # BUG (dtype)
    t = torch.ones(n, dtype=kind, device=device())
    dist.all_reduce(t)
    return t.tolist()


def size_mismatch(world_size: int = 2, dtype: bool = False, detail: bool = False,
                  fixed: bool = False, timeout: float = 2.0) -> Outcome:
    """Different element counts (or dtypes): gloo aborts a rank with SIGABRT in milliseconds."""
    return scenario("size_mismatch", _size_mismatch_step, world_size, timeout=timeout,
                    env=DETAIL if detail else None, dtype=dtype, fixed=fixed)


@scenario_fn
def _crashed_rank_step(rank, world_size, victim=1, how="raise"):
    import os
    import signal
    import torch
    import torch.distributed as dist

    if rank == victim:
        if how == "raise":
            raise ValueError(f"corrupt batch on rank {rank}")      # BUG: a bug in one rank
        if how == "exit":
            os._exit(3)                                            # BUG: e.g. sys.exit in a library
        os.kill(os.getpid(), signal.SIGKILL)                       # BUG: e.g. the OOM killer
    t = torch.ones(4, device=device())
    dist.all_reduce(t)                # survivors: "Connection closed/reset by peer" at once
    return t.tolist()


def crashed_rank(world_size: int = 3, victim: int = 1, how: str = "raise",
                 timeout: float = 5.0) -> Outcome:
    """Rank ``victim`` raises, exits or is SIGKILLed; the others see its connection close."""
    if how not in ("raise", "exit", "kill"):
        raise ValueError(f"how must be 'raise', 'exit' or 'kill', not {how!r}")
    return scenario("crashed_rank", _crashed_rank_step, world_size, timeout=timeout,
                    victim=victim, how=how)


# ------------------------------------------------------------ the flight recorder
@scenario_fn
def _flight_recorder_step(rank, world_size, skipper=1):
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device=device())
    try:
        dist.all_reduce(t)            # collective #1
        dist.broadcast(t, src=0)      # collective #2
        if rank != skipper:
            dist.all_reduce(t)        # BUG: collective #3 is skipped on one rank
    except RuntimeError as exc:       # gloo raises at the timeout; dump the recorder ourselves
        return flight_record(exc)
    return flight_record()


def flight_recorder(world_size: int = 2, skipper: int = 1, timeout: float = 2.0) -> Outcome:
    """Each rank returns its flight record; comparing them names the rank and collective number."""
    return scenario("flight_recorder", _flight_recorder_step, world_size, timeout=timeout,
                    env=FR_ENV, skipper=skipper)


# ------------------------------------------------------------ NCCL (GPUs only)
NCCL_ENV = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def nccl_watchdog(world_size: int = 2, timeout: float = 5.0) -> Outcome:
    """GPUs only: :func:`skipped_collective` on NCCL, with NCCL's debugging switched on.

    Rank 1 skips the all_reduce. On NCCL the call on rank 0 only *enqueues* the
    work on a CUDA stream; rank 0 then blocks reading the result, and NCCL's
    watchdog thread notices the timeout and tears the process down
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). ``NCCL_DEBUG=INFO`` logs to the ranks'
    *stdout* (``NCCL_DEBUG_FILE`` redirects it: NVIDIA's NCCL environment variables page),
    torch's watchdog to their stderr; the flight recorder dumps on the timeout
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``).
    """
    return scenario("nccl_watchdog", _skipped_collective_step, world_size, timeout=timeout,
                    env=NCCL_ENV, backend="nccl", deadline=timeout + 25.0)


# ------------------------------------------------------------ a diagnosis exercise
def _load_shard(rank):
    import time

    time.sleep(60)                    # a data-loading stall (a slow disk, a dead NFS mount...)


@scenario_fn
def _mystery_step(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.full((4,), float(rank), device=device())
    dist.all_reduce(t)                # step 1: everyone is here
    if rank == world_size // 2:
        _load_shard(rank)
    dist.broadcast(t, src=0)          # step 2
    dist.all_reduce(t)                # step 3
    return t.tolist()


def mystery(world_size: int = 4, deadline: float = 2.5) -> JobResult:
    """A job that hangs (no timeout error, just a deadline): read the stacks to find out why.

    Returns the failed :class:`JobResult`; ``res[r].where`` says where rank r was stuck.
    """
    return run(_mystery_step, world_size, timeout=30.0, deadline=deadline, backend="gloo",
               check=False, echo=False)


