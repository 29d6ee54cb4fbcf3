"""Parent-side handles on the zygote and on a pool of warm ranks (used by :mod:`labkit.launch`).

A :class:`Zygote` is one ``python -m labkit._zygote`` process per job
environment. A :class:`Pool` is ``world_size`` ranks forked from it with a
process group initialised; :meth:`Pool.run_job` sends one job to every rank
and collects what each one did — returned, raised, died, or hung (then its
stack is dumped) — into a :class:`~labkit.result.JobResult`.
"""
from __future__ import annotations

import io
import linecache
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections import ChainMap
from multiprocessing.connection import Connection, wait

import cloudpickle

from . import errors
from .result import JobResult, RankResult
from .stacks import parse_stack, where_stuck

_GRACE_S = 1.5       # after a first failure, how long the others get to report
_START_S = 120.0     # zygote import + rank start-up, on a loaded 2-core machine
_REAP_S = 3.0        # how long a killed rank may take to be reaped


def _code_reduce_keeping_filename(code):
    # cloudpickle 3 renames every shipped code object "<dynamic-code>"; keep the real
    # file (a notebook cell's too) so tracebacks and stack dumps point at the learner's code.
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename},
                              cloudpickle.Pickler.dispatch_table)


def _dumps(obj) -> bytes:
    with io.BytesIO() as f:
        _Pickler(f).dump(obj)
        return f.getvalue()


_TB_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+), in .+$')


def with_sources(tb: str) -> str:
    """Add the source line under each traceback frame that lacks one.

    A rank cannot see the source of a notebook cell; the kernel's linecache can.
    """
    out, lines = [], tb.splitlines()
    for i, line in enumerate(lines):
        out.append(line)
        m = _TB_FRAME.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m and (not nxt.startswith(m[1] + "  ") or _TB_FRAME.match(nxt)):
            src = linecache.getline(m[2], int(m[3])).strip()
            if src:
                out.append(f"{m[1]}    {src}")
    return "\n".join(out) + "\n"


def pickle_job(fn, args, kwargs) -> bytes:
    """Pickle the job by value, naming the part that cannot be sent."""
    try:
        return _dumps((fn, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - find the culprit for the message
        parts = [("the function", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
                [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        for name, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception:  # noqa: BLE001
                raise errors.InvalidJob(
                    f"{name} ({type(obj).__name__}) cannot be sent to the ranks: {exc}. "
                    f"Pass plain values or tensors and create open files, locks, generators "
                    f"or sockets inside the function instead.") from exc
        raise errors.InvalidJob(f"the job cannot be pickled: {exc}") from exc


class Zygote:
    """A preloaded process (torch imported) that forks ranks on request."""

    def __init__(self, env: dict, tmp: str):
        self.env = env
        self.exits: dict[int, int] = {}          # pid -> wait status, reported by the zygote
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = os.path.join(tmp, f"zygote-{len(os.listdir(tmp))}.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "labkit._zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, start_new_session=True)  # kernel interrupts miss ranks
        theirs.close()
        # Reap it the moment it exits (idle, or killed), so no zombie waits for the next job.
        threading.Thread(target=self.proc.wait, daemon=True, name="labkit-reaper").start()
        self.gpus: int | None = None             # known once the zygote says hello

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self, timeout: float):
        """One message (and any file descriptors) or None on timeout; EOF raises."""
        if self.sock.fileno() < 0:
            raise errors.LabkitError("the rank launcher (zygote) was closed")
        if not wait([self.sock], timeout):
            return None
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 64)
        if not data:
            raise errors.LabkitError(f"the rank launcher (zygote) died: {self.log_tail()}")
        msg = pickle.loads(data)
        if msg[0] == "exit":
            self.exits[msg[1]] = msg[2]
        return msg, fds

    def drain(self) -> None:
        """Record the exit reports that have arrived, without waiting."""
        while self._recv(0) is not None:
            pass

    def gpu_count(self) -> int:
        """Wait until the zygote is ready (torch imported) and return its GPU count."""
        deadline = time.monotonic() + _START_S
        while self.gpus is None:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise errors.LabkitError(f"the rank launcher did not start in {_START_S:.0f} s")
            if got[0][0] == "hello":
                self.gpus = got[0][2]
        return self.gpus

    def fork(self, spec: dict) -> tuple[list[int], list[Connection]]:
        deadline = time.monotonic() + _START_S
        self.gpu_count()
        self.sock.send(pickle.dumps(("fork", spec)))
        while True:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise errors.LabkitError("the rank launcher did not fork the ranks")
            if got[0][0] == "forked":
                return got[0][1], [Connection(fd) for fd in got[1]]

    def wait_exits(self, pids, timeout: float = _REAP_S) -> None:
        deadline = time.monotonic() + timeout
        try:
            while any(p not in self.exits for p in pids) and time.monotonic() < deadline:
                self._recv(deadline - time.monotonic())
        except errors.LabkitError:
            pass  # the zygote died: its ranks died with it (PR_SET_PDEATHSIG)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:].strip() or "(no output)"
        except OSError:
            return "(no log)"

    def close(self) -> None:
        self.sock.close()                      # EOF: the zygote kills its ranks and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Pool:
    """``world_size`` warm ranks with a process group, forked from one zygote."""

    def __init__(self, zygote: Zygote, spec: dict, tmp: str):
        self.zygote, self.spec, self.healthy = zygote, spec, True
        self.dir = os.path.join(tmp, f"pool-{time.monotonic_ns()}")
        os.makedirs(self.dir)
        spec = dict(spec, dir=self.dir)
        self.pids, self.conns = zygote.fork(spec)
        self.jobs, self.last_used = 0, time.monotonic()
        try:
            self._rendezvous(min(_START_S, max(30.0, spec["timeout"])))
        except BaseException:
            self.kill()
            raise

    def _rendezvous(self, limit: float) -> None:
        port = self._expect(0, "port", limit)
        for conn in self.conns[1:]:
            conn.send(("port", port))
        for rank in range(len(self.conns)):
            self._expect(rank, "ready", limit)

    def _expect(self, rank: int, kind: str, limit: float):
        conn = self.conns[rank]
        try:
            if conn.poll(limit):
                msg = conn.recv()
                if msg[0] == kind:
                    return msg[1]
        except (EOFError, OSError):
            pass
        self.zygote.wait_exits([self.pids[rank]], 1.0)
        raise errors.LabkitError(
            f"rank {rank} of {len(self.conns)} failed to start its process group "
            f"({self.spec['backend']}): {self.zygote.log_tail()}")

    def reusable(self, zygote: Zygote, spec: dict) -> bool:
        try:
            self.zygote.drain()
        except errors.LabkitError:  # the launcher went away (idle timeout): so did the ranks
            return False
        fresh_enough = time.monotonic() - self.last_used < spec["idle_timeout"] - 5
        return (zygote is self.zygote and spec == self.spec and self.healthy and fresh_enough
                and not any(p in self.zygote.exits for p in self.pids))

    def run_job(self, payload: bytes, deadline: float) -> JobResult:
        self.jobs += 1
        n = len(self.conns)
        files = [(os.path.join(self.dir, f"job{self.jobs}-rank{r}.out"),
                  os.path.join(self.dir, f"job{self.jobs}-rank{r}.err")) for r in range(n)]
        ranks = [RankResult(rank=r, pid=self.pids[r]) for r in range(n)]
        pending, died = set(range(n)), set()
        job = dict(payload=payload, cwd=os.getcwd(), sys_path=list(sys.path))
        for r, conn in enumerate(self.conns):
            try:
                conn.send(("job", dict(job, stdout=files[r][0], stderr=files[r][1])))
            except OSError:
                pass  # a dead rank: its EOF is read below
        end = time.monotonic() + deadline
        first_fail = None
        while pending:
            limit = end if first_fail is None else min(end, first_fail + _GRACE_S)
            ready = wait([self.conns[r] for r in pending] + [self.zygote.sock],
                         max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for r in [r for r in pending if self.conns[r] in ready]:
                try:
                    _, report = self.conns[r].recv()
                    _fill(ranks[r], report)
                    self.healthy &= report.get("pg_alive", True)
                except (EOFError, OSError):
                    died.add(r)
                    ranks[r].t_fail = time.time()
                pending.discard(r)
                if not ranks[r].ok and first_fail is None:
                    first_fail = time.monotonic()
            if self.zygote.sock in ready:
                self.zygote.drain()
        for r in pending:  # still running: find out where before they go
            ranks[r].stack = self._dump_stack(r)
            ranks[r].where = where_stuck(parse_stack(ranks[r].stack))
        failed = bool(pending or died or first_fail is not None)
        if failed:
            self.kill(keep_files=True)
        for r in died:
            _fill_exit(ranks[r], self.zygote.exits.get(self.pids[r]))
        for r, (out, err) in enumerate(files):
            ranks[r].stdout, ranks[r].stderr = _read(out), _read(err)
        if failed:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.last_used = time.monotonic()
        return JobResult(world_size=n, backend=self.spec["backend"], ranks=ranks)

    def _dump_stack(self, rank: int) -> str:
        path = os.path.join(self.dir, f"rank{rank}.stack")
        open(path, "w").close()
        try:
            os.kill(self.pids[rank], signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        end, last = time.monotonic() + 1.0, -1
        while time.monotonic() < end:  # faulthandler writes from the signal handler
            time.sleep(0.02)
            size = os.path.getsize(path)
            if size and size == last:
                break
            last = size
        return _read(path)

    def kill(self, keep_files: bool = False) -> None:
        """SIGKILL every rank and wait until the zygote has reaped them all."""
        self.healthy = False
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for conn in self.conns:
            conn.close()
        self.zygote.wait_exits(self.pids)
        if not keep_files:
            shutil.rmtree(self.dir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
    finally:
        if path.endswith((".out", ".err")):
            try:
                os.unlink(path)
            except OSError:
                pass


def _fill(rank: RankResult, report: dict) -> None:
    rank.status, rank.wall_s = report["status"], report.get("wall_s")
    if rank.status == "ok":
        rank.value = cloudpickle.loads(report["value"])
    else:
        rank.error, rank.t_fail = report.get("error"), report.get("t_fail")
        rank.traceback = with_sources(report.get("traceback") or "")


def _fill_exit(rank: RankResult, status: int | None) -> None:
    code = None if status is None else os.waitstatus_to_exitcode(status)
    if code is not None and code < 0:
        rank.status, rank.signal = "signaled", signal.Signals(-code).name
    else:
        rank.status, rank.exitcode = "exited", code


_HINTS = {
    "SIGABRT": "a C++ abort: with gloo this is usually a collective called with a different "
               "size or dtype on different ranks. Give every rank the same shape and dtype.",
    "SIGKILL": "killed from outside (kill -9) or by the out-of-memory killer.",
    "SIGSEGV": "a crash in native code; the Python stack at the crash is in its stderr.",
}


def error_for(result: JobResult) -> errors.JobFailed:
    """The error to raise for a failed job: its class follows the rank that failed first."""
    first = result.first_failure()
    cls = {"raised": errors.RankError, "unpicklable": errors.ResultNotPicklable,
           "exited": errors.RankCrashed, "signaled": errors.RankCrashed,
           "hung": errors.JobTimeout}[first.status]
    lines = [first.describe()]
    others = [r for r in result.ranks if r is not first]
    lines += ["  " + r.describe() for r in others if not r.ok]
    ok = [r.rank for r in others if r.ok]
    if ok:
        lines.append(f"  rank{'s' * (len(ok) > 1)} {', '.join(map(str, ok))} returned normally")
    if first.status == "hung":
        lines.append("Hint: a rank waiting in a collective usually means another rank never called "
                     "it (a collective under `if rank == 0:`, mismatched collectives, an early "
                     "return). If the work is only slow, pass a larger timeout=.")
    elif first.status == "signaled":
        lines.append("Hint: " + _HINTS.get(first.signal, "see the rank's stderr above."))
    elif first.status == "exited":
        lines.append("Hint: os._exit()/sys.exit() in the function, or a crash; see its stderr.")
    elif first.status == "unpicklable":
        lines.append("Hint: return plain Python values, tensors, or lists/dicts of them.")
    lines.append("Details per rank: err.result (a JobResult); rank outputs are printed above.")
    err = cls("\n".join(lines), result)
    if first.traceback:
        err.__cause__ = errors.RemoteTraceback(f"Traceback of rank {first.rank}:\n{first.traceback}")
    return err
