"""Parent-side handles on the zygote and on a pool of warm ranks (used by :mod:`labkit.runtime.launch`).

A :class:`Zygote` is one ``python -m labkit.runtime.zygote`` process per job
environment. A :class:`Pool` is ``world_size`` ranks forked from it with a
process group initialised; :meth:`Pool.run_job` sends one job to every rank
and collects what each one did — returned, raised, died, or hung (then its
stack is dumped) — into a :class:`~labkit.runtime.result.JobResult`.
:class:`Interrupts` makes Ctrl-C (the notebook's stop button) end any of its waits at once.
"""
from __future__ import annotations

import math
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from .errors import LabkitError
from .pickling import ValueNotLoadable, load_value, with_sources
from .procs import Tree, signal_all
from .protocol import (EXIT, FORK, FORKED, HELLO, JOB, PORT, READY, PoolSpec,
                       output_paths, stack_path)
from .result import JobResult, RankResult
from .stacks import parse_stack, where_stuck

_GRACE_S = 1.5       # after a first failure, how long the others get to report
_START_S = 120.0     # zygote import + rank start-up, on a loaded 2-core machine
_REAP_S = 3.0        # how long a killed rank may take to be reaped
_CLOSE_S = 1.0       # how long a closed zygote may take to exit before it is killed


class Interrupts:
    """Ctrl-C (SIGINT) during :func:`labkit.run`: never lost, raised where the runner cleans up.

    Python runs a signal's handler in the main thread at its next bytecode, wherever that is:
    inside a finaliser (a ``__del__`` or weakref callback the garbage collector runs) the
    ``KeyboardInterrupt`` is only printed ("Exception ignored in ...") and lost. And a wait in
    C (``poll``) is cut short only when the kernel delivered the signal to that thread, not to
    another one. Either way the runner used to sit in its wait until the job's deadline. So,
    while :meth:`watch` is on (main thread, Python's own SIGINT handler in place):

    * SIGINT's handler records the interrupt; it raises at once only in :meth:`immediate`
      blocks (pickling and unpickling: raising anywhere there is safe);
    * the signal's wake-up descriptor (:func:`signal.set_wakeup_fd`, written by the C handler
      in whichever thread the signal lands) is in every wait of the runner (:func:`wait_for`);
    * each wait, and :meth:`check`, raise ``KeyboardInterrupt`` once one is recorded, except
      in :meth:`deferred` blocks: killing ranks is never cut short by a second Ctrl-C.

    With another SIGINT handler in place (the user's own) only the wake-up descriptor is used:
    waits still wake, and that handler decides what a Ctrl-C does.
    """

    _current: "Interrupts | None" = None

    def __init__(self, fd: int | None = None, own: bool = False):
        self.fd, self.own, self.hit, self.seen = fd, own, False, b""
        self._immediate = self._deferred = 0

    @classmethod
    def current(cls) -> "Interrupts | None":
        """The watch on, if this thread is the one it serves (signals only reach the main one)."""
        on = cls._current
        return on if on is not None and threading.current_thread() is threading.main_thread() \
            else None

    @classmethod
    @contextmanager
    def watch(cls):
        """Watch for Ctrl-C during one job; an interrupt not raised yet is raised at the end."""
        if cls._current is not None or threading.current_thread() is not threading.main_thread():
            yield cls.current() or cls()      # nested, or a thread that SIGINT never interrupts
            return
        handler = signal.getsignal(signal.SIGINT)
        r, w = os.pipe()
        self, old_fd = cls(r, own=handler is signal.default_int_handler), -1
        try:
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if self.own:
                signal.signal(signal.SIGINT, self._on_sigint)
            cls._current = self
            yield self
        finally:
            cls._current = None
            if self.own:
                signal.signal(signal.SIGINT, handler)
            signal.set_wakeup_fd(old_fd)
            self._drain()
            if old_fd >= 0 and self.seen:  # whoever waited on it before us gets its bytes
                try:
                    os.write(old_fd, self.seen)
                except OSError:
                    pass
            os.close(r)
            os.close(w)
            self.fd = None
        self.check()  # the job is over: an interrupt not raised yet is raised now

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True
        if self._immediate and not self._deferred:
            raise KeyboardInterrupt

    def _drain(self) -> None:
        while self.fd is not None:
            try:
                got = os.read(self.fd, 512)
            except BlockingIOError:
                return
            self.seen += got
            if self.own and signal.SIGINT in got:
                self.hit = True
            if not got:
                return

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C came since the last check (not when deferred)."""
        self._drain()
        if self.hit and not self._deferred:
            self.hit = False
            raise KeyboardInterrupt

    @classmethod
    @contextmanager
    def immediate(cls):
        """A block that Ctrl-C may cut anywhere (nothing in it needs cleaning up); one that
        a finaliser in it swallowed is raised at its end."""
        with cls._counting("_immediate") as on:
            if on is not None:
                on.check()
            yield
            if on is not None:
                on.check()

    @classmethod
    def deferred(cls):
        """A block that Ctrl-C never cuts (cleanup); an interrupt in it is raised later."""
        return cls._counting("_deferred")

    @classmethod
    @contextmanager
    def _counting(cls, name: str):
        on = cls.current()
        if on is not None:
            setattr(on, name, getattr(on, name) + 1)
        try:
            yield on
        finally:
            if on is not None:
                setattr(on, name, getattr(on, name) - 1)


def wait_for(objects: list, timeout: float) -> list:
    """Like :func:`multiprocessing.connection.wait`, ended by Ctrl-C (``KeyboardInterrupt``).

    Without :meth:`Interrupts.watch` on (another thread) it is the plain wait.
    """
    on = Interrupts.current()
    if on is None:
        return _poll(objects, timeout)
    end = time.monotonic() + timeout
    while True:
        on.check()
        ready = _poll([*objects, on.fd], max(0.0, end - time.monotonic()))
        if on.fd not in ready:
            return ready
        on.check()
        ready.remove(on.fd)
        if ready or time.monotonic() >= end:
            return ready


def _poll(objects: list, timeout: float) -> list:
    """The objects (connections, sockets, descriptors) readable, closed or failed within
    ``timeout`` seconds, as :func:`multiprocessing.connection.wait` says, in one poll(2) and a
    quarter of its time (a repeated job waits 4-5 times)."""
    poller, by_fd = select.poll(), {}
    for obj in objects:
        fd = obj if isinstance(obj, int) else obj.fileno()
        by_fd[fd] = obj
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(math.ceil(max(0.0, timeout) * 1e3))]


class Zygote:
    """A preloaded process (torch imported) that forks ranks on request."""

    def __init__(self, env: dict):
        self.env = env
        self.exits: dict[int, int] = {}          # pid -> wait status, reported by the zygote
        self.dir = tempfile.mkdtemp(prefix=f"labkit-{os.getpid()}-")
        self.tree = Tree("rank launcher", dirs=[self.dir])   # it, its ranks, their children
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = os.path.join(self.dir, "zygote.log")
        try:
            with open(self.log, "wb") as log:
                self.proc = self.tree.start(
                    [sys.executable, "-m", "labkit.runtime.zygote", str(theirs.fileno())],
                    env={**os.environ, **env}, pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True)              # kernel interrupts miss ranks
        except BaseException:
            self.sock.close()
            self.tree.stop()
            raise
        finally:
            theirs.close()
        self.tree.kept.add(self.proc.pid)        # warm on purpose, until closed
        # Reap it the moment it exits (idle, or killed), so no zombie waits for the next job.
        threading.Thread(target=self.proc.wait, daemon=True, name="labkit-reaper").start()
        self.gpus: int | None = None             # known once the zygote says hello

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self, timeout: float):
        """One message (and any file descriptors) or None on timeout; EOF raises."""
        if self.sock.fileno() < 0:
            raise LabkitError("the rank launcher (zygote) was closed")
        if not wait_for([self.sock], timeout):
            return None
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 64)
        if not data:
            raise LabkitError(f"the rank launcher (zygote) died: {self.log_tail()}")
        msg = pickle.loads(data)
        if msg[0] == EXIT:
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
                raise LabkitError(f"the rank launcher did not start in {_START_S:.0f} s")
            if got[0][0] == HELLO:
                self.gpus = got[0][2]
        return self.gpus

    def fork(self, spec: PoolSpec,
             dynamo: bool = True) -> tuple[list[int], list[Connection], bool]:
        """Fork ``spec.world_size`` ranks: their pids, connections, and whether they have
        ``torch._dynamo`` (``dynamo``: the job needs it, so the zygote preloads it first if it
        has not yet; :mod:`labkit.runtime.preload`).

        Interrupted once the zygote is forking, it still takes the zygote's answer (for at most
        ``_REAP_S``) to kill and reap what was forked, so the zygote stays warm; a zygote that
        fails, or does not answer, is closed with every rank it forked."""
        self.gpu_count()
        self.sock.send(pickle.dumps((FORK, spec, dynamo)))
        try:
            return self._forked(_START_S)
        except KeyboardInterrupt:
            with Interrupts.deferred():
                try:
                    pids, conns, _ = self._forked(_REAP_S)
                    self.kill(pids, conns)
                except BaseException:  # noqa: BLE001 - no answer: the zygote goes instead
                    self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _forked(self, limit: float) -> tuple[list[int], list[Connection], bool]:
        deadline = time.monotonic() + limit
        while True:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise LabkitError("the rank launcher did not fork the ranks")
            if got[0][0] == FORKED:
                return got[0][1], [Connection(fd) for fd in got[1]], got[0][2]

    def kill(self, pids: list[int], conns: list[Connection]) -> None:
        """SIGKILL these ranks and wait until this zygote has reaped them all."""
        with Interrupts.deferred():
            signal_all(pids, signal.SIGKILL)
            for conn in conns:
                conn.close()
            self.wait_exits(pids)

    def wait_exits(self, pids, timeout: float = _REAP_S) -> None:
        deadline = time.monotonic() + timeout
        try:
            while any(p not in self.exits for p in pids) and time.monotonic() < deadline:
                self._recv(deadline - time.monotonic())
        except LabkitError:
            pass  # the zygote died: its ranks died with it (PR_SET_PDEATHSIG)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:].strip() or "(no output)"
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """End the zygote and its tree: at EOF it kills and reaps its ranks and exits; one still
        busy after ``_CLOSE_S`` (importing, forking) is killed, and so is every process left
        carrying its mark (:meth:`~labkit.runtime.procs.Tree.stop`)."""
        with Interrupts.deferred():
            self.sock.close()
            self.tree.stop(grace=_CLOSE_S)


class Pool:
    """``world_size`` warm ranks with a process group, forked from one zygote."""

    def __init__(self, zygote: Zygote, spec: PoolSpec, dynamo: bool = True):
        self.zygote, self.spec, self.healthy = zygote, spec, True
        self.dir = os.path.join(zygote.dir, f"pool-{time.monotonic_ns()}")
        os.makedirs(self.dir)
        self.pids, self.conns, self.dynamo = zygote.fork(spec.with_dir(self.dir), dynamo)
        self.jobs, self.last_used = 0, time.monotonic()
        try:
            self._rendezvous(min(_START_S, max(30.0, spec.timeout)))
        except BaseException:
            self.kill()
            raise
        zygote.tree.kept.update(self.pids)       # warm on purpose, until killed

    def _rendezvous(self, limit: float) -> None:
        port = self._expect(0, PORT, limit)
        for conn in self.conns[1:]:
            conn.send((PORT, port))
        for rank in range(len(self.conns)):
            self._expect(rank, READY, limit)

    def _expect(self, rank: int, kind: str, limit: float):
        conn = self.conns[rank]
        try:
            if wait_for([conn], limit):
                msg = conn.recv()
                if msg[0] == kind:
                    return msg[1]
        except (EOFError, OSError):
            pass
        self.zygote.wait_exits([self.pids[rank]], 1.0)
        raise LabkitError(
            f"rank {rank} of {len(self.conns)} failed to start its process group "
            f"({self.spec.backend}): {self.zygote.log_tail()}")

    def reusable(self, zygote: Zygote, spec: PoolSpec, dynamo: bool = False) -> bool:
        """Whether a job of ``spec`` can run here (``dynamo``: it needs torch._dynamo, which
        ranks forked before the zygote's preload lack: a fresh pool gets it for all at once)."""
        try:
            self.zygote.drain()
        except LabkitError:  # the launcher went away (idle timeout): so did the ranks
            return False
        fresh_enough = time.monotonic() - self.last_used < spec.idle_timeout - 5
        return (zygote is self.zygote and spec == self.spec and self.healthy and fresh_enough
                and (self.dynamo or not dynamo)
                and not any(p in self.zygote.exits for p in self.pids))

    def run_job(self, payload: bytes, deadline: float, trace: bool = False) -> JobResult:
        self.jobs += 1
        n = len(self.conns)
        files = [output_paths(self.dir, r) for r in range(n)]
        ranks = [RankResult(rank=r, pid=self.pids[r]) for r in range(n)]
        pending, died, reported = set(range(n)), set(), {}
        job = ForkingPickler.dumps((JOB, dict(payload=payload, cwd=os.getcwd(),
                                              sys_path=list(sys.path), trace=trace)))
        for conn in self.conns:
            try:
                conn.send_bytes(job)
            except OSError:
                pass  # a dead rank: its EOF is read below
        end = time.monotonic() + deadline
        first_fail = None
        while pending:
            limit = end if first_fail is None else min(end, first_fail + _GRACE_S)
            ready = wait_for([self.conns[r] for r in pending] + [self.zygote.sock],
                             max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for r in [r for r in pending if self.conns[r] in ready]:
                try:
                    with Interrupts.immediate():
                        _, report = self.conns[r].recv()
                        _fill(ranks[r], report)
                        reported[r] = report["output_bytes"]
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
        for r, paths in enumerate(files):   # a rank that reported says which files hold text
            sizes = reported.get(r, (1, 1))
            ranks[r].stdout, ranks[r].stderr = (_read(p) if size else ""
                                                for p, size in zip(paths, sizes))
        if failed:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.last_used = time.monotonic()
        return JobResult(world_size=n, backend=self.spec.backend, ranks=ranks)

    def _dump_stack(self, rank: int) -> str:
        path = stack_path(self.dir, rank)
        open(path, "w").close()
        try:
            os.kill(self.pids[rank], signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        end, last = time.monotonic() + 1.0, -1
        while time.monotonic() < end:  # faulthandler writes from the signal handler
            wait_for([], 0.02)
            size = os.path.getsize(path)
            if size and size == last:
                break
            last = size
        return _read(path)

    def kill(self, keep_files: bool = False) -> None:
        """SIGKILL every rank and wait until the zygote has reaped them all."""
        self.healthy = False
        self.zygote.tree.kept.difference_update(self.pids)
        self.zygote.kill(self.pids, self.conns)
        if not keep_files:
            shutil.rmtree(self.dir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _fill(rank: RankResult, report: dict) -> None:
    rank.status, rank.wall_s = report["status"], report.get("wall_s")
    rank.trace, rank.trace_dropped = report.get("trace"), report.get("trace_dropped", 0)
    if rank.status == "ok":
        try:
            rank.value = load_value(report["value"], report.get("value_type"))
            return
        except ValueNotLoadable as exc:  # pickled in the rank, not loadable here
            cause = exc.__cause__
            report = {"status": "unpicklable", "error": str(exc), "t_fail": time.time(),
                      "traceback": "".join(traceback.format_exception(cause)) if cause else ""}
            rank.status = "unpicklable"
    rank.error, rank.t_fail = report.get("error"), report.get("t_fail")
    rank.traceback = with_sources(report.get("traceback") or "")


def _fill_exit(rank: RankResult, status: int | None) -> None:
    code = None if status is None else os.waitstatus_to_exitcode(status)
    if code is not None and code < 0:
        rank.status, rank.signal = "signaled", signal.Signals(-code).name
    else:
        rank.status, rank.exitcode = "exited", code
