"""Running a submission in a fresh kernel for the grader, and collecting its answers.

Used by :mod:`labkit.grading.grader` (and, through it, the pytest plugin); nothing here
scores anything. One submission:

1. A fresh ``python3`` kernel (nbclient) in an empty working directory, with
   ``LABKIT_QUIZ_DIR`` set to the grader's banks, in a process tree of its own
   (:class:`labkit.runtime.procs.Tree`: a mark in its environment that every descendant
   inherits, the zygote and ranks included).
2. Each code cell runs with a limit ``min(cell_timeout, time left for the
   notebook)``. A cell that raises is recorded and the run goes on. At the limit
   the kernel is interrupted (KeyboardInterrupt; the labkit runner then kills
   its ranks); a cell that ignores the interrupt for ``grace`` seconds gets the
   kernel killed. Outputs are dropped, never stored or read.
3. A cell that kills the kernel (``os._exit``, a signal, ``exit()``) or ignores
   interrupts is skipped and the notebook runs again from the top in a new
   kernel, at most ``max_restarts`` times, within the same notebook time limit.
4. A collector cell (not part of the notebook) writes each requested variable to
   its own file in a folder of the grader's, so one bad value (or a collector
   killed half-way) loses only itself: answers as JSON (plain data: numbers,
   text, lists of them); exercise functions and the inputs of computed questions
   as cloudpickles.
5. The kernel is shut down, then its tree is stopped: every process still carrying its
   mark is killed, and nothing outlives the submission.

Nothing here or in the grader unpickles what a submission produced: a pickle can
run code when it is loaded, so pickles are only ever loaded by the checker
process of :mod:`labkit.grading.sandbox` (and the ranks it starts).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
from nbclient.util import ensure_async

from ..runtime.procs import Tree

__all__ = ["CellRun", "Execution", "execute", "collector_source", "read_values", "KERNEL_START_S"]

KERNEL_START_S = 60.0   # how long a kernel may take to start (each run of the notebook)

_COLLECT = r'''
def __labkit_collect__(names, pickled, out):
    import json, os, pickle, sys
    try:
        import cloudpickle as dumper
    except Exception:
        dumper = pickle

    def plain(v):   # answers cross as JSON: numbers, text, booleans, lists and dicts of them
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:     # numpy / torch scalars
            return plain(v.item())
        if hasattr(v, "tolist"):                                     # arrays, tensors
            return plain(v.tolist())
        if isinstance(v, (list, tuple, set, frozenset)):
            items = [plain(x) for x in v]
            return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: plain(x) for k, x in v.items()}
        raise TypeError(f"a {type(v).__module__}.{type(v).__qualname__}, not plain data "
                        f"(a number, text, True/False, or a list of them)")

    ns = sys._getframe(1).f_globals
    for name in names:
        base = os.path.join(out, name)
        if name not in ns:
            open(base + ".missing", "w").close()
            continue
        try:
            if name in pickled:
                data, ext = dumper.dumps(ns[name]), ".pkl"
            else:
                data, ext = json.dumps(plain(ns[name]), allow_nan=True).encode(), ".json"
        except BaseException as exc:
            with open(base + ".err", "w") as f:
                f.write(type(exc).__name__ + ": " + str(exc)[:300])
            continue
        with open(base + ext, "wb") as f:
            f.write(data)
    open(os.path.join(out, ".done"), "w").close()
__labkit_collect__(%r, %r, %r)
del __labkit_collect__
'''


@dataclass
class CellRun:
    """What happened to one code cell (``cell`` counts all cells from 1, as JupyterLab shows)."""

    cell: int
    status: str        # ok | error | timeout | killed kernel | unresponsive | skipped | not run
    detail: str = ""
    first_line: str = ""


@dataclass
class Execution:
    cells: list[CellRun] = field(default_factory=list)
    values: dict[str, tuple[str, Any]] = field(default_factory=dict)  # name -> (state, data)
    notes: list[str] = field(default_factory=list)
    restarts: int = 0
    collected: bool = False
    wall_s: float = 0.0


class _Unresponsive(Exception):
    """The kernel did not answer an interrupt within the grace period."""


class _Client(NotebookClient):
    """nbclient with outputs dropped and a hard stop for cells that ignore interrupts."""

    grace: float = 5.0
    limit: float = 60.0
    timed_out: bool = False
    reply: dict | None = None

    def output(self, outs, msg, display_id, cell_index):  # never stored: outputs are not trusted
        return None

    async def _async_handle_timeout(self, timeout, cell=None):
        self.timed_out = True
        await ensure_async(self.km.interrupt_kernel())
        try:  # the interrupted cell's own reply, if the interrupt worked
            return await ensure_async(self.kc.shell_channel.get_msg(timeout=self.grace))
        except Empty:
            raise _Unresponsive() from None


def execute(nb, names: list[str], *, pickled=(), cell_timeout: float, notebook_timeout: float,
            collect_timeout: float = 60.0, max_restarts: int = 2, grace: float = 5.0,
            env: dict[str, str] | None = None) -> Execution:
    """Run notebook ``nb`` and collect the variables ``names`` (see the module docstring);
    those in ``pickled`` as pickles (exercise functions, a key's inputs), the rest as JSON."""
    t0 = time.monotonic()
    ex = Execution()
    work = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    try:
        asyncio.run(_run(nb, names, set(pickled), ex, work, dict(env or {}), cell_timeout,
                         t0 + notebook_timeout, collect_timeout, max_restarts, grace))
        ex.values = read_values(work / "answers", names)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ex.wall_s = time.monotonic() - t0
    return ex


async def _run(nb, names, pickled, ex, work, env, cell_timeout, deadline, collect_timeout,
               max_restarts, grace) -> None:
    skip: dict[int, str] = {}
    for attempt in range(max_restarts + 1):
        shutil.rmtree(work / "answers", ignore_errors=True)
        (work / "answers").mkdir()
        cwd = work / f"cwd{attempt}"
        cwd.mkdir()
        tree = Tree("grading kernel")   # the kernel and everything its cells start
        ex.cells, killer = [], None
        client = _Client(nb, timeout=None, timeout_func=lambda cell: client.limit,
                         interrupt_on_timeout=True, allow_errors=True, kernel_name="python3",
                         startup_timeout=KERNEL_START_S, iopub_timeout=2, record_timing=False)
        client.grace = grace
        client.on_cell_executed = lambda **kw: setattr(client, "reply", kw["execute_reply"])
        try:
            await _start(client, cwd, tree.env({**os.environ, **env}))
            killer = await _cells(client, nb, ex, skip, cell_timeout, deadline)
            if killer is None:
                await _collect(client, names, pickled, work / "answers", collect_timeout, ex)
        finally:
            await _stop(client, tree)
        if killer is None:
            return
        skip[killer.cell - 1] = f"skipped: in an earlier run it {killer.detail}"
        ex.restarts += 1
        if attempt == max_restarts:
            ex.notes.append(f"the kernel died {attempt + 1} times; gave up, answers not collected")
        elif time.monotonic() >= deadline:
            ex.notes.append("no time left to run the notebook again after the kernel died")
            return
        else:
            ex.notes.append(f"cell {killer.cell} {killer.detail}; the notebook was run again "
                            f"from the top without it")


async def _start(client: _Client, cwd: Path, env: dict) -> None:
    env.pop("PYTEST_CURRENT_TEST", None)
    client.km = client.create_kernel_manager()
    client.km.shutdown_wait_time = 3.0
    await client.async_start_new_kernel(cwd=str(cwd), env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # its chatter is not ours
    await client.async_start_new_kernel_client()


async def _cells(client, nb, ex, skip, cell_timeout, deadline) -> CellRun | None:
    """Run every code cell; return the CellRun of a cell that killed the kernel, else None."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        run = CellRun(i + 1, "ok", first_line=cell.source.strip().splitlines()[0][:60])
        ex.cells.append(run)
        left = deadline - time.monotonic()
        if i in skip:
            run.status, run.detail = "skipped", skip[i]
            continue
        if left <= 0:
            run.status, run.detail = "not run", "the notebook time limit was reached"
            continue
        client.limit = max(0.5, min(cell_timeout, left))
        client.timed_out, client.reply = False, None
        try:
            await client.async_execute_cell(cell, i)
        except DeadKernelError:
            run.status, run.detail = "killed kernel", f"killed the kernel{_exit_code(client)}"
            return run
        except _Unresponsive:
            run.status = "unresponsive"
            run.detail = (f"ran past the {client.limit:.0f} s limit and ignored the interrupt "
                          f"for {client.grace:.0f} s, so the kernel was killed")
            return run
        content = (client.reply or {}).get("content", {})
        if any(p.get("source") == "ask_exit" and not p.get("keepkernel")
               for p in content.get("payload") or ()):
            run.status, run.detail = "killed kernel", "called exit(), which ends the kernel"
            return run   # the kernel goes down after replying: the next cell would be blamed
        if client.timed_out:
            run.status = "timeout"
            run.detail = f"ran past the {client.limit:.0f} s limit and was interrupted"
        elif content.get("status") == "error":
            run.status = "error"
            run.detail = f"{content.get('ename')}: {str(content.get('evalue'))[:200]}"
    return None


async def _collect(client, names, pickled, out: Path, limit: float, ex: Execution) -> None:
    import nbformat

    cell = nbformat.v4.new_code_cell(collector_source(names, out, pickled))
    client.nb.cells.append(cell)
    client.limit, client.timed_out = limit, False
    try:
        await client.async_execute_cell(cell, len(client.nb.cells) - 1, store_history=False)
    except (DeadKernelError, _Unresponsive):
        ex.notes.append("the kernel died while its answers were being collected")
    ex.collected = (out / ".done").exists()
    if not ex.collected and client.timed_out:
        ex.notes.append(f"collecting the answers ran past {limit:.0f} s")


async def _stop(client: _Client, tree: Tree) -> None:
    """Shut the kernel down, then stop its tree: anything its cells started is killed too."""
    km = client.km
    try:
        if km is not None and km.has_kernel:
            await ensure_async(km.shutdown_kernel(now=not await ensure_async(km.is_alive())))
    except Exception:  # noqa: BLE001  (a half-dead kernel: the sweep below finishes the job)
        pass
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
        if km is not None:
            try:
                await ensure_async(km.cleanup_resources())
            except Exception:  # noqa: BLE001
                pass
        tree.stop()


def _exit_code(client) -> str:
    try:
        code = client.km.provisioner.process.poll()
    except Exception:  # noqa: BLE001
        return ""
    if code is None:
        return ""
    return f" (signal {-code})" if code < 0 else f" (exit code {code})"


def collector_source(names: list[str], folder: str | Path, pickled=()) -> str:
    """The code of the cell that saves each variable in ``names`` to its own file in ``folder``:
    as JSON (plain data: the learner's answers), or, for the names in ``pickled`` (exercise
    functions, a key's inputs), as a pickle that only a checker process ever loads."""
    return _COLLECT % (list(names), sorted(pickled), str(folder))


_CHECKED = r'''
def __labkit_checked__(variables, out):
    import json, sys
    exercise = sys.modules.get("labkit.grading.exercise")
    ns = sys._getframe(1).f_globals
    with open(out, "w") as f:
        for qid, name in (variables.items() if exercise else ()):
            s = exercise.last_check(qid, ns.get(name))
            if s is not None:
                f.write(json.dumps(s.to_dict(), default=str) + "\n")
__labkit_checked__(%r, %r)
del __labkit_checked__
'''


def checked_source(variables: dict[str, str], out: str | Path) -> str:
    """The code of a cell that writes, as JSON lines to ``out``, the Score of each exercise
    (id -> its variable) that the kernel itself last checked on the object the variable holds
    now. For the lab's own notebooks only: a submission's kernel could write anything there."""
    return _CHECKED % (dict(variables), str(out))


def read_values(folder: Path, names: list[str]) -> dict[str, tuple[str, Any]]:
    """What the collector saved, without running any of it: name -> ("ok", plain data from
    JSON) | ("pickle", bytes, never loaded here) | ("missing", "") | ("error", message) |
    ("lost", "")."""
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        base = folder / name
        if base.with_suffix(".json").exists():
            try:
                out[name] = ("ok", json.loads(base.with_suffix(".json").read_text()))
            except ValueError as exc:
                out[name] = ("error", f"unreadable answer: {exc}")
        elif base.with_suffix(".pkl").exists():
            out[name] = ("pickle", base.with_suffix(".pkl").read_bytes())
        elif base.with_suffix(".err").exists():
            out[name] = ("error", base.with_suffix(".err").read_text(errors="replace"))
        elif base.with_suffix(".missing").exists():
            out[name] = ("missing", "")
        else:
            out[name] = ("lost", "")
    return out
