"""The child side of the runner: a preloaded "zygote" that forks ranks, and the rank loop.

Why a zygote: importing torch takes over a second, and four ranks importing it
at once on two cores take several. The zygote is started once per kernel
(``python -m labkit.runtime.zygote FD``), imports torch *before* any thread pool or
CUDA context exists, and then forks ranks on request in milliseconds. Each
rank initialises a real process group (TCPStore on a free port chosen by the
OS, then gloo or NCCL) and waits for jobs, so repeated jobs cost a few
milliseconds. The kernel talks to the zygote over a SOCK_SEQPACKET socket and
to each rank over its own socket, handed over with SCM_RIGHTS.

Nothing here is public; :mod:`labkit.runtime.pool` is the parent side, and
:mod:`labkit.runtime.protocol` spells the messages both sides exchange.
"""
from __future__ import annotations

import faulthandler
import gc
import io
import os
import pickle
import random
import select
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from ..portable.ending import keep
from . import preload
from .procs import die_with_parent, signal_all
from .protocol import (DONE, EXIT, FORK, FORKED, HELLO, JOB, PORT, READY, PoolSpec,
                       output_paths, stack_path)


def _send(sock: socket.socket, msg, fds=()) -> None:
    socket.send_fds(sock, [pickle.dumps(msg)], list(fds))


# --------------------------------------------------------------------- zygote
def zygote_main(fd: int) -> None:
    ctrl = socket.socket(fileno=fd)
    os.environ["LABKIT_RANK_PROCESS"] = "1"  # labkit imported in a rank never prestarts a zygote
    import cloudpickle  # noqa: F401  (preload: everything a rank needs)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401
    idle_s = float(os.environ.get("LABKIT_IDLE_TIMEOUT", "600"))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    try:
        _send(ctrl, (HELLO, os.getpid(), _probe_gpus()))
        _serve(ctrl, children, wake_r, wake_w, idle_s)
    except BaseException:  # noqa: BLE001 - e.g. the kernel closed mid-fork (a broken pipe)
        traceback.print_exc()
    # Whatever ended the loop, leave at once (not through the interpreter's slow exit with
    # torch loaded), taking every rank with us: killed and reaped, no zombie left for init.
    signal_all(children, signal.SIGKILL)
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    os._exit(0)


def _serve(ctrl: socket.socket, children: set[int], wake_r: int, wake_w: int,
           idle_s: float) -> None:
    """Fork ranks on request until the kernel goes, asks us to exit, or we were idle long."""
    preloaded, quiet = False, preload.IDLE_S
    while True:
        ready, _, _ = select.select([ctrl, wake_r], [], [], idle_s if preloaded else quiet)
        if not ready and not preloaded:
            # The first idle moment: preload torch._dynamo (labkit.runtime.preload) for every
            # later rank. Not before "hello": the kernel may still be busy importing. Then one
            # collection, so that the imports' garbage is not frozen with them (_fork_ranks).
            preload.preload_dynamo()
            gc.collect()
            preloaded = True
            continue
        if not ready and not children:
            return  # idle: the kernel starts a new zygote when it needs one
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(ctrl, children)
        if ctrl not in ready:
            continue
        data = ctrl.recv(1 << 16)
        if not data:  # the kernel is gone
            return
        msg = pickle.loads(data)
        if msg[0] == FORK:
            spec, wanted = msg[1], msg[2]
            if wanted and not preloaded:
                # A job that needs it, asked for before the first idle moment (Run All, a
                # script): import it here once rather than in each of its ranks at once (on 2
                # cores a cold first job of 4 DDP ranks took 9-10 s that way, 4.5-5.5 s this way).
                preload.preload_dynamo()
                preloaded = True
            conns, pids = _fork_ranks(spec, ctrl, wake_r, wake_w)
            children.update(pids)
            quiet = preload.IDLE_AFTER_FORK_S     # their job first
            try:
                _send(ctrl, (FORKED, pids, preloaded), [c.fileno() for c in conns])
            finally:
                for c in conns:
                    c.close()
        elif msg[0] == EXIT:
            return


def _probe_gpus() -> int:
    """Count GPUs in a throwaway child: CUDA initialised here would break every later fork."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import torch
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            os.write(w, str(n).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return int(out or 0)


def _reap(ctrl: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        try:
            _send(ctrl, (EXIT, pid, status))
        except OSError:
            pass


def _fork_ranks(spec: PoolSpec, ctrl, wake_r: int, wake_w: int):
    gc.freeze()   # a rank's collections leave the pages it shares with us alone (rank_main)
    mine, pids = [], []
    for rank in range(spec.world_size):
        parent_end, child_end = socket.socketpair()
        mine.append(parent_end)
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for s in [ctrl, *mine]:
                    s.close()
                os.close(wake_r)
                os.close(wake_w)
                die_with_parent()  # not Linux: the socket EOF checks still apply
                rank_main(Connection(child_end.detach()), rank, spec)
            finally:
                os._exit(70)  # rank_main never returns; this is a last resort
        child_end.close()
        pids.append(pid)
    return mine, pids


# ----------------------------------------------------------------------- rank
def rank_main(conn: Connection, rank: int, spec: PoolSpec) -> None:
    import torch
    import torch.distributed as dist

    world_size, timeout = spec.world_size, timedelta(seconds=spec.timeout)
    _batch_scheduling()
    # Write-through streams: output survives os._exit and interleaves with C++ logs.
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), write_through=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # SIGSEGV/SIGABRT: stack in stderr
    stack_file = open(stack_path(spec.dir, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    outputs = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
               for path in output_paths(spec.dir, rank)]
    torch.set_num_threads(spec.threads)
    # Seed every device type once, as a fresh process is seeded: for devices not started yet
    # (CUDA on a GPU box, and the others on any build) this queues a seeding call to run when
    # the device starts, so a job's own torch.manual_seed replaces that call instead of adding
    # one, and the exercise checkers' census of live objects sees nothing new.
    torch.seed()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout, wait_for_workers=False)
        conn.send((PORT, store.port))
    else:
        store = dist.TCPStore("127.0.0.1", conn.recv()[1], world_size, False, timeout)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port))
    if "nccl" in spec.backend:                  # "cpu:gloo,cuda:nccl": CUDA tensors on NCCL
        torch.cuda.set_device(rank)
    dist.init_process_group(spec.backend, store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    conn.send((READY, os.getpid()))
    # Out of the collector's sight: what the rank starts with (the zygote froze its own objects,
    # torch's ~166,000, ~285,000 with torch._dynamo preloaded, before forking; this adds the
    # store and the group), so a job's collections scan only what jobs made. Without it, 2 or 3
    # of every 40 repeated jobs of 4 ranks took 12-16 ms instead of ~2 (a collection in all 4
    # at once); with it, 1 of 160 took over 5 ms (6.4). A job's own garbage is still collected,
    # except a cycle through a frozen object. (A job that calls gc.unfreeze() brings them back
    # into sight: slower, not wrong; labkit.grading.integrity's census freezes them again.
    # Not gc.get_freeze_count() after every job to notice it: it walks every frozen object,
    # 40 ms a job.)
    gc.freeze()
    devnull = os.open(os.devnull, os.O_WRONLY)
    while conn.poll(spec.idle_timeout):
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] != JOB:
            break
        report = _run_job(msg[1], rank, world_size, devnull, outputs)
        report["pg_alive"] = dist.is_initialized()
        torch.set_num_threads(spec.threads)
        conn.send((DONE, report))
        if report["status"] != "ok":
            # Leave like a failed rank under torchrun: peers blocked in a collective
            # see the connection close at once instead of waiting for the timeout.
            os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def _batch_scheduling() -> None:
    """Run this rank (and the threads it starts: gloo's) under Linux's SCHED_BATCH.

    A woken batch thread waits for the running one to block instead of preempting it
    (sched(7)). When the notebook's kernel hands a job to 4 ranks on 2 cores, each rank it wakes
    would otherwise take the kernel's core before the kernel had woken the next: without it a
    4-rank job of one all_reduce took 1.2-1.8 times as long in the median, and its slowest
    tenth about 3 times as long (README, "Launch latency").
    Ranks still get their full share of the CPU. LABKIT_BATCH_RANKS=0 keeps the default policy.
    """
    if os.environ.get("LABKIT_BATCH_RANKS", "1") != "0" and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:      # a container's seccomp profile may refuse it: run as before
            pass


def _run_job(job: dict, rank: int, world_size: int, devnull: int, outputs: list[int]) -> dict:
    import cloudpickle
    import torch

    for fd, out in zip((1, 2), outputs):   # emptied: the notebook read the last job's output
        os.ftruncate(out, 0)
        os.dup2(out, fd)
    os.chdir(job["cwd"])
    sys.path[:] = job["sys_path"]
    # Fresh seeds for each job, as a fresh process has (forked ranks would otherwise share one
    # RNG state): the CPU generator's, and CUDA's once this rank has started CUDA (before that,
    # the seeding queued at the rank's start runs when CUDA starts). torch.seed() here would
    # format the Python stack for every device type's queue, 0.2 ms of a 2-core machine's CPU
    # per rank and job.
    seed = torch.default_generator.seed()
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    random.seed()
    report: dict = {"status": "ok"}
    recorder = _recorder(rank) if job.get("trace") else None
    t0 = time.perf_counter()
    try:
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        if recorder is None:
            value = fn(rank, world_size, *args, **kwargs)
        else:
            with recorder:
                value = fn(rank, world_size, *args, **kwargs)
    except SystemExit as exc:  # sys.exit() in a rank ends that rank, as it would under torchrun
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        os._exit(code)
    except BaseException as exc:  # noqa: BLE001 - the notebook decides what to do with it
        keep(exc)  # never freed (the rank leaves with os._exit): freeing it can hang a rank
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)  # user frames
        report.update(status="raised", error=f"{type(exc).__name__}: {exc}",
                      exc_type=type(exc).__name__, t_fail=time.time(), traceback="".join(tb))
    report["wall_s"] = time.perf_counter() - t0
    if recorder is not None:  # also for a rank that raised: where it was is in its trace
        report["trace"], report["trace_dropped"] = recorder.records, recorder.dropped
    if report["status"] == "ok":
        try:
            report["value"] = cloudpickle.dumps(_to_cpu(value))
            report["value_type"] = f"{type(value).__module__}.{type(value).__qualname__}"
        except Exception as exc:  # noqa: BLE001
            report.update(status="unpicklable", exc_type=type(exc).__name__,
                          error=f"returned a {type(value).__module__}.{type(value).__qualname__}"
                                f" that cannot be pickled ({type(exc).__name__}: {exc})",
                          traceback=traceback.format_exc(), t_fail=time.time())
    for fd in (1, 2):
        os.dup2(devnull, fd)
    report["output_bytes"] = [os.fstat(out).st_size for out in outputs]  # 0: nothing to read
    return report


def _recorder(rank: int):
    """A :class:`labkit.runtime.commtrace.CommRecorder` for this job (imported only when asked)."""
    from .commtrace import CommRecorder

    return CommRecorder(rank)


def _to_cpu(value):
    """Detach tensors and move them to the CPU so the notebook never touches CUDA."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):  # .copy() keeps OrderedDict (state_dict) and defaultdict
        out = value.copy()
        for k, v in value.items():
            out[k] = _to_cpu(v)
        return out
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


if __name__ == "__main__":
    zygote_main(int(sys.argv[1]))
