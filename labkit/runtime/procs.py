"""Starting, stopping and finding the lab's processes: the one owner of these mechanisms.

Every process the lab starts belongs to a :class:`Tree`: the rank launcher of :func:`labkit.run`
and the ranks it forks (:mod:`labkit.runtime.pool`), a torchrun job's agents and workers
(:mod:`labkit.runtime.torchrun`), a grading kernel and whatever its cells start
(:mod:`labkit.grading.kernel`), a checker process (:mod:`labkit.grading.sandbox`), a benchmark's
script (:mod:`labkit.runtime.bench`). A tree is marked by one environment variable, :data:`MARK`,
that every descendant inherits, so the whole tree is found — orphans whose parent died
included — and stopped by one verb, :meth:`Tree.stop`, on every path: a job's end, an error, an
interrupt, the kernel's exit (one ``atexit`` hook, :func:`stop_all`). A tree started inside
another one (a kernel's own :func:`labkit.run`) extends the outer mark, so stopping the outer
tree stops it too.

* :class:`Tree` — start processes marked, list them (:meth:`~Tree.live`), stop them all.
* :func:`run` — one command in a tree of its own, stopped whatever happens (a time limit, Ctrl-C).
* :func:`ours` — what this process started and is still alive, less (if asked) what an owner
  keeps alive on purpose (:func:`kept`: the warm ranks and their launcher); :func:`marked` and
  :func:`marks` find the processes of given trees. The tests' leak check asks :func:`ours`.
* :func:`free_port`, :func:`die_with_parent`, :func:`signal_all` — a free TCP port, Linux's
  parent-death signal, signals to pids that may be gone.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable

import psutil

__all__ = ["MARK", "Tree", "run", "ours", "kept", "marks", "stop_all", "marked", "free_port",
           "die_with_parent", "signal_all"]

MARK = "LABKIT_TREE"     # "<outer mark>/<pid>.<hex>": one segment per tree, outermost first
_PR_SET_PDEATHSIG = 1
_REAP_S = 5.0            # how long a SIGKILLed process may take to go, on a loaded machine
_SWEEPS = 5              # a dying parent may still start a child: the sweep repeats
_EXEC_S = 0.5            # how long a process seen mid-exec (no environment yet) is read again
_FRESH_S = 10.0          # only a process younger than this can be mid-exec: older ones with no
                         # environment keep it empty (Chromium's zygotes: a learner's browser)

_lock = threading.Lock()
_trees: dict[str, "Tree"] = {}   # the trees not stopped yet, in the order they were made
_minted: dict[str, str] = {}     # every mark made here -> its tree's ``what`` (orphans of a
                                 # stopped tree are ours too)


class Tree:
    """Processes started for one purpose, marked so that every descendant is found and stopped.

    ``what`` names the purpose in messages. Start roots with :meth:`start` (or hand
    :meth:`env` to a library that starts them, as jupyter_client starts a kernel); ``dirs``
    are removed when the tree stops; ``kept`` holds the pids its owner keeps alive on purpose
    (the leak check leaves them). :meth:`stop` is the one way to end it.
    """

    def __init__(self, what: str, dirs: Iterable[str] = ()):
        self.what, self.dirs = what, list(dirs)
        self.token = f"{os.environ.get(MARK, '')}/{os.getpid()}.{uuid.uuid4().hex}".lstrip("/")
        self.owner = os.getpid()
        self.roots: list[subprocess.Popen] = []
        self.kept: set[int] = set()
        self.stopped = False
        with _lock:
            _trees[self.token] = self
            _minted[self.token] = what

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) with this tree's mark."""
        return {**(os.environ if base is None else base), MARK: self.token}

    def start(self, argv: list[str], *, env: dict | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` in this tree (``env`` as :meth:`env`'s ``base``); other keywords go to
        :class:`subprocess.Popen`."""
        if self.stopped:
            raise RuntimeError(f"the {self.what} was stopped: start a new tree")
        proc = subprocess.Popen(argv, env=self.env(env), **popen)
        self.roots.append(proc)
        return proc

    def live(self) -> list[psutil.Process]:
        """Live processes of this tree (and of trees started inside it), wherever they are."""
        return marked(self.token)

    def stop(self, sig: int | None = None, grace: float = 0.0) -> list[int]:
        """Stop the whole tree; returns the pids killed by the sweep.

        ``sig`` (e.g. SIGTERM) is sent to the roots first, and the roots get up to ``grace``
        seconds to exit on their own (a zygote whose socket was closed, a torchrun agent
        stopping its workers); then every root left is SIGKILLed and reaped, and every process
        carrying the mark is killed until none is left. Safe to call again, from any path."""
        alive = [p for p in self.roots if p.poll() is None]
        if sig is not None:
            for p in alive:
                _signal(p, sig)
        end = time.monotonic() + grace
        while alive and time.monotonic() < end:
            time.sleep(0.02)
            alive = [p for p in alive if p.poll() is None]
        for p in alive:
            _signal(p, signal.SIGKILL)
        for p in self.roots:
            try:
                p.wait(_REAP_S)
            except subprocess.TimeoutExpired:
                pass
        killed = _sweep(self.token)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.stopped = True
        with _lock:
            _trees.pop(self.token, None)
        return killed

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else f"{len(self.roots)} root(s)"
        return f"<Tree {self.what!r} {state} {self.token}>"


def run(what: str, argv: list[str], timeout: float, **popen) -> tuple[int, bytes, bytes]:
    """Run ``argv`` to its end in a tree of its own: (returncode, stdout, stderr).

    Past ``timeout`` seconds :class:`subprocess.TimeoutExpired` is raised; then, on an error or
    an interrupt too, the tree is stopped first (so is anything the command left behind)."""
    tree, proc = Tree(what), None
    try:
        proc = tree.start(argv, **popen)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        tree.stop()
        for pipe in (proc.stdin, proc.stdout, proc.stderr) if proc is not None else ():
            if pipe is not None:
                pipe.close()


def ours(*, kept_too: bool = True) -> dict[int, psutil.Process]:
    """Live processes this process started: its descendants and every process carrying a mark
    made here (orphans re-parented to init included); with ``kept_too=False``, less those an
    owner keeps alive on purpose (:func:`kept`)."""
    found = {p.pid: p for p in psutil.Process().children(recursive=True)}
    found.update((p.pid, p) for p in marked(marks()))
    skip = set() if kept_too else kept()
    return {pid: p for pid, p in found.items() if pid not in skip and _alive(p)}


def marks(what: str | None = None) -> list[str]:
    """The marks of every tree made here (stopped ones too), or of those named ``what``."""
    with _lock:
        return [t for t, w in _minted.items() if what is None or w == what]


def kept() -> set[int]:
    """Pids that their tree's owner keeps alive on purpose (the warm ranks and their launcher)."""
    with _lock:
        pids = {pid for t in _trees.values() for pid in t.kept}
    return {pid for pid in pids if _alive_pid(pid)}


def stop_all() -> None:
    """Stop every tree this process made and has not stopped (newest first): run at exit."""
    with _lock:
        trees = [t for t in _trees.values() if t.owner == os.getpid()]   # not a fork's parent's
    for t in reversed(trees):
        t.stop()


atexit.register(stop_all)


def marked(tokens: str | Iterable[str]) -> list[psutil.Process]:
    """Live (non-zombie) processes carrying one of these marks, or a mark inside one of them.

    A process in the middle of ``execve`` shows an empty environment for a moment (its parent's
    ``Popen`` has already returned: the exec passed its point of no return), longer on a loaded
    machine; such a process is read again for up to :data:`_EXEC_S` rather than missed. Only one
    created in the last :data:`_FRESH_S` seconds can be mid-exec (the exec follows its fork at
    once): an older process with no environment keeps it empty and is not waited for. Chromium's
    zygotes are such processes; waiting for them cost every call half a second while a browser
    ran on the machine (the learner's own, serving JupyterLab)."""
    wanted = [tokens] if isinstance(tokens, str) else list(tokens)
    if not wanted:
        return []

    def ours(env: dict) -> bool:
        mark = env.get(MARK)
        return bool(mark) and any(mark == t or mark.startswith(t + "/") for t in wanted)

    out, pending = [], []
    for p in psutil.process_iter():
        env = _environ(p)
        if env is None:
            continue
        if env:
            if ours(env):
                out.append(p)
        elif _userland(p) and _fresh(p):
            pending.append(p)
    end = time.monotonic() + _EXEC_S
    while pending and time.monotonic() < end:
        time.sleep(0.01)
        still = []
        for p in pending:
            env = _environ(p)
            if env and ours(env):
                out.append(p)
            elif env == {}:
                still.append(p)
        pending = still
    return out


def _environ(p: psutil.Process) -> dict | None:
    """A live process's environment ({} while it execs), None for this process, a zombie or
    one that is gone or not ours to read."""
    try:
        if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.environ()
    except (psutil.Error, OSError):
        return None


def _fresh(p: psutil.Process) -> bool:
    """Created in the last :data:`_FRESH_S` seconds (so it may still be in its exec)."""
    try:
        return time.time() - p.create_time() < _FRESH_S
    except psutil.Error:
        return False


def _userland(p: psutil.Process) -> bool:
    """Not a kernel thread (those have no environment at all, and kthreadd, pid 2, as parent)."""
    try:
        return p.pid > 2 and p.ppid() != 2
    except psutil.Error:
        return False


def _sweep(token: str) -> list[int]:
    killed: list[int] = []
    for _ in range(_SWEEPS):
        left = marked(token)
        if not left:
            break
        killed += [p.pid for p in left]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        _wait_dead(left, _REAP_S)
    return killed


def _wait_dead(procs: list[psutil.Process], timeout: float) -> None:
    """Wait until each process is dead: gone, or a zombie. A killed process that is not our
    child (a rank whose launcher died first) is reaped by init, and in a container init may
    take seconds to do it; ``psutil.wait_procs`` would wait for that, though nothing runs."""
    end = time.monotonic() + timeout
    while any(_alive(p) for p in procs) and time.monotonic() < end:
        time.sleep(0.005)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _alive_pid(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, that no one but another explicit choice will take.

    A port from ``bind(0)`` comes from the kernel's ephemeral range, which every outgoing
    connection and every other ``bind(0)`` (a standalone torchrun's store, gloo's pairs) draws
    from too: between our probe and the rendezvous' own bind it can be handed out again. So the
    port is drawn at random below that range (``/proc/sys/net/ipv4/ip_local_port_range``),
    where the kernel never assigns one, and probed before it is returned.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(_FIRST_CHOSEN_PORT, low) if low > _FIRST_CHOSEN_PORT + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host} below {low} after 200 tries")


_FIRST_CHOSEN_PORT = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                         # Linux's default, and close to other systems'


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the process that forked it dies.

    Returns False where the platform has no parent-death signal (then only the
    callers' socket-EOF checks and :func:`stop_all` at exit clean up).
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def signal_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every pid; pids already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
