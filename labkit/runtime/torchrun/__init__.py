"""torchrun from a notebook: live logs, restarts you can watch, workers you can kill, nothing left behind.

Notebook 05 launches real ``torchrun`` agents (``sys.executable -m
torch.distributed.run``, so the notebook's own torch is used) and streams
their output into the cell as it happens: the agent's log lines (rendezvous,
"Worker group FAILED ... will restart", the error summary) and each rank's
output, labelled by rank::

    job = lk.torchrun.launch("labkit.torchrun.train", ["--crash-rank", "1", "--crash-at-step",
                             "20", "--step-delay", "0.05"], nproc_per_node=2, max_restarts=2)
    job.follow(until="resumed from")   # print lines as they come, stop at a match
    job.kill(rank=0)                   # SIGKILL a worker, as the OOM killer would
    run = job.wait()                   # follow to the end: a Run
    run.ok, run.restarts, run.attempts, run.summary

``run(...)`` is launch + wait. ``launch(..., nnodes=2)`` starts two agents
that meet in a c10d rendezvous on 127.0.0.1 (a free port): two "nodes" on
one machine. Every agent gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without
it, restarted gloo groups in torch 2.13 often fail with ``Gloo connectFullMesh
failed``), ``OMP_NUM_THREADS=1`` and ``LOGLEVEL=INFO``. Every process of a job
belongs to one :class:`~labkit.runtime.procs.Tree` (its mark in their environment); when the
job ends, fails, times out or is interrupted, each one still alive is killed, and agents die
with the kernel.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable

import psutil

from ..errors import LabkitError
from ..procs import Tree, free_port, marked, marks, signal_all
from .log import Line, Run, parse_agent

__all__ = ["launch", "run", "command", "Job", "Run", "Line", "TorchrunError", "TorchrunTimeout",
           "TorchrunFailed", "AGENT_ENV", "live_processes"]

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
             "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
_WHAT = "torchrun job"
# Runs first in each agent: ask Linux for SIGTERM when the parent (the kernel) dies, so the
# agent stops its workers; then become torchrun. (Elsewhere: job.stop() and procs.stop_all.)
_WRAP = ("import os, signal, sys\n"
         "from labkit.runtime.procs import die_with_parent\n"
         "die_with_parent(signal.SIGTERM)\n"
         "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
         "os.execv(sys.argv[2], sys.argv[2:])\n")


class TorchrunError(LabkitError):
    """Base class of the errors raised by :mod:`labkit.runtime.torchrun`."""


class TorchrunTimeout(TorchrunError):
    """The job ran past its time limit; every process of it has been killed. ``err.last`` holds
    the job's last lines from before it was stopped."""

    def __init__(self, msg: str, last: list[Line] | tuple = ()):
        super().__init__(msg)
        self.last = list(last)


class TorchrunFailed(TorchrunError):
    """torchrun exited with an error (``run(check=True)``); ``err.run`` holds the whole log."""

    def __init__(self, msg: str, run: Run):
        super().__init__(msg)
        self.run = run


def command(target: str, args: list[str] | tuple = (), *, nproc_per_node: int = 2,
            max_restarts: int = 0, nnodes: int | str = 1, rdzv_endpoint: str | None = None,
            rdzv_id: str = "lab05", log_dir: str | None = None,
            extra: list[str] | tuple = ()) -> list[str]:
    """The torchrun command line as a list.

    ``target`` is a module (``"labkit.torchrun.train"``, run with ``-m``) or a ``.py`` path.
    One node: ``--standalone``; more: ``--rdzv-backend=c10d --rdzv-endpoint=...``.

    >>> " ".join(command("labkit.torchrun.train", ["--epochs", "1"])[1:])
    '-m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=0 -m labkit.torchrun.train --epochs 1'
    """
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", "--local-addr=127.0.0.1"]
    cmd += [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    if log_dir:
        cmd += ["--tee=3", f"--log-dir={log_dir}"]
    cmd += list(extra)
    cmd += [target] if target.endswith(".py") else ["-m", target]
    return cmd + [str(a) for a in args]


class Job:
    """One or more running torchrun agents: follow their output, kill workers, stop them all."""

    def __init__(self, cmds: list[list[str]], env: dict, cwd: str | None, echo: bool | str,
                 dirs: list[str] = ()):
        self.tree = Tree(_WHAT, dirs)          # the agents, their workers, anything they start
        self.echo, self.cmds = echo, cmds
        self.lines: list[Line] = []
        self.t0 = time.monotonic()
        self._q: queue.Queue = queue.Queue()
        self._state: list[dict] = [{} for _ in cmds]   # per agent: local -> global rank ...
        self._eof = 0
        self._result: Run | None = None
        full_env = {**os.environ, **AGENT_ENV, **env}
        self.agents: list[subprocess.Popen] = []
        self._threads = []
        try:
            for node, cmd in enumerate(cmds):
                p = self.tree.start([sys.executable, "-c", _WRAP, str(os.getpid()), *cmd],
                                    env=full_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
                self.agents.append(p)
                t = threading.Thread(target=self._read, args=(node, p), daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:
            self.stop()
            raise

    def _read(self, node: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = parse_agent(raw.decode("utf-8", "replace").rstrip("\n"), node,
                               time.monotonic() - self.t0, self._state[node], len(self.cmds))
            self._q.put(line)
        self._q.put(None)

    @property
    def token(self) -> str:
        """The mark every process of this job carries (:func:`live_processes` takes it)."""
        return self.tree.token

    @property
    def running(self) -> bool:
        return any(p.poll() is None for p in self.agents)

    def follow(self, until: str | re.Pattern | Callable[[Line], bool] | None = None,
               timeout: float = 180.0) -> Line | None:
        """Print the job's lines as they arrive; return the first line matching ``until``.

        Returns None when every agent has exited (the job is then finished and
        cleaned up). ``until`` is a substring, a compiled regex or a predicate on
        :class:`Line`. Past ``timeout`` seconds, or on an interrupt, the whole job
        is killed and the error raised.
        """
        match = (until if callable(until) else (lambda ln: until.search(ln.text) is not None)
                 if isinstance(until, re.Pattern) else (lambda ln: until in ln.text)) if until else None
        end = time.monotonic() + timeout
        try:
            while True:
                if self._result is not None:
                    return None
                try:
                    line = self._q.get(timeout=min(0.2, max(0.0, end - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() >= end:
                        last = self.lines[-8:]      # before the stop: not the agents' dying words
                        self.stop()
                        raise TorchrunTimeout(
                            f"torchrun did not finish within {timeout:.0f} s; all its processes "
                            f"were killed. Last lines:\n" + "\n".join(ln.format() for ln in last),
                            last) from None
                    continue
                if line is None:
                    self._eof += 1
                    if self._eof == len(self.agents):
                        self._finish()
                        return None
                    continue
                self.lines.append(line)
                if self.echo and line.shown(self.echo):
                    print(line.format(), flush=True)
                if match and match(line):
                    return line
        except BaseException:
            if self._result is None:
                self.stop()
            raise

    def wait(self, timeout: float = 180.0) -> Run:
        """Follow to the end and return the :class:`Run` (kills everything after ``timeout``)."""
        self.follow(None, timeout)
        return self._result

    def workers(self) -> dict[int, psutil.Process]:
        """The live worker processes, by global rank (from each worker's ``RANK``)."""
        out = {}
        for p in self.agents:
            try:
                for child in psutil.Process(p.pid).children():
                    if child.status() != psutil.STATUS_ZOMBIE and "RANK" in child.environ():
                        out[int(child.environ()["RANK"])] = child
            except psutil.Error:
                pass
        return dict(sorted(out.items()))

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) to the worker of global ``rank``; return its pid."""
        procs = self.workers()
        if rank not in procs:
            raise TorchrunError(f"no live worker with rank {rank} (live: {sorted(procs)}): it "
                                f"has not started yet, or the job ended. Follow the job until a "
                                f"worker prints, then kill it.")
        signal_all([procs[rank].pid], sig)
        name = signal.Signals(sig).name
        line = Line(time.monotonic() - self.t0, -1, "notebook", None,
                    f"sent {name} to rank {rank} (pid {procs[rank].pid})")
        self.lines.append(line)
        if self.echo:
            print(line.format(), flush=True)
        return procs[rank].pid

    def stop(self) -> None:
        """Kill every process of the job now (agents first get SIGTERM, 2 s to stop workers)."""
        self.tree.stop(signal.SIGTERM, grace=2.0)
        self._finish()

    def _finish(self) -> None:
        if self._result is not None:
            return
        for p in self.agents:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.tree.stop()  # orphans: workers whose agent died without stopping them
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        for p in self.agents:
            if p.stdout:
                p.stdout.close()
        self._result = Run(self.cmds, [p.returncode for p in self.agents], self.lines,
                           time.monotonic() - self.t0)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        if self._result is None:
            self.stop()


def live_processes(token: str | None = None) -> list[psutil.Process]:
    """Live processes of the job with ``token`` (``job.token``), or (default) of every job this
    process launched.

    Agents and workers are found by their tree's mark in their environment, so a worker
    whose agent died (an orphan) is found too.
    """
    return marked(token if token else marks(_WHAT))


def launch(target: str, args: list | tuple = (), *, nproc_per_node: int = 2, max_restarts: int = 0,
           nnodes: int | str = 1, env: dict[str, str] | None = None, cwd: str | None = None,
           echo: bool | str = True, extra: list[str] | tuple = ()) -> Job:
    """Start torchrun on ``target`` (a module like ``"labkit.torchrun.train"`` or a ``.py``
    path); don't wait.

    Args:
        args: the script's own arguments.
        nproc_per_node: workers per agent; max_restarts: torchrun's ``--max-restarts``.
        nnodes: agents to start on this machine; more than 1 meet in a c10d
            rendezvous on 127.0.0.1 at a free port (multi-node semantics, one machine).
            ``"MIN:MAX"`` (e.g. ``"1:2"``) is elastic: MAX agents start, and the job
            goes on with as few as MIN after a node leaves.
        env: extra environment for the agents and workers (on top of :data:`AGENT_ENV`).
        echo: ``True`` prints rank output and the agent's key lines, ``"all"`` every
            line, ``False`` nothing (the lines are kept in ``job.lines`` either way).

    Returns a :class:`Job`; call ``job.follow()``/``job.wait()`` to stream and finish.
    """
    low, _, high = str(nnodes).partition(":")
    agents = int(high or low) if (high or low).isdigit() and low.isdigit() else 0
    if agents < 1 or int(low) > agents or nproc_per_node < 1 or max_restarts < 0:
        raise TorchrunError(f"need nnodes >= 1 (or 'MIN:MAX'), nproc_per_node >= 1, "
                            f"max_restarts >= 0; got {nnodes!r}, {nproc_per_node}, {max_restarts}.")
    _check_target(str(target), cwd)
    logs = [tempfile.mkdtemp(prefix="labkit-torchrun-") for _ in range(agents)]
    endpoint = f"127.0.0.1:{free_port()}" if str(nnodes) != "1" else None
    rdzv_id = f"lab-{uuid.uuid4().hex[:8]}"             # one job: every agent the same id
    cmds = [command(target, args, nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                    nnodes=nnodes, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, log_dir=d,
                    extra=extra) for d in logs]
    return Job(cmds, dict(env or {}), cwd, echo, logs)   # its tree removes the logs


def _check_target(target: str, cwd: str | None) -> None:
    """Refuse a script or module the workers could not start, before starting anything."""
    import importlib.util

    if target.endswith(".py"):
        path = target if os.path.isabs(target) or cwd is None else os.path.join(cwd, target)
        if not os.path.isfile(path):
            raise TorchrunError(f"no script {path}: give the path of a .py file (relative to "
                                f"cwd={cwd or os.getcwd()}), or a module name like "
                                f"'labkit.torchrun.train'.")
        return
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise TorchrunError(f"no module {target!r} importable here: torchrun runs it as "
                            f"`python -m {target}`. Check the name, or pass a .py path.")


def run(target: str, args: list | tuple = (), *, timeout: float = 180.0, check: bool = False,
        **kw) -> Run:
    """Launch torchrun (see :func:`launch`), stream its output, and return the finished :class:`Run`.

    With ``check=True`` a failed run raises :class:`TorchrunFailed` with torchrun's error summary.
    """
    result = launch(target, args, **kw).wait(timeout)
    if check and not result.ok:
        raise TorchrunFailed(f"torchrun exited with code {result.returncode}.\n"
                             f"{result.summary or result.tail()}", result)
    return result
