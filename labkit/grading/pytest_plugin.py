"""pytest plugin for the lab's notebooks (loaded by ``-p labkit.grading.pytest_plugin``).

Three things happen on top of nbval when ``pytest`` runs the notebooks:

1. **Every check in a solved notebook must pass.** ``LABKIT_EXPECT_SOLVED=1`` makes a quiz or
   exercise check that is not correct raise instead of print; the kernel inherits it when nbval
   starts it, so this plugin sets it for notebooks under ``solutions/`` and clears it elsewhere
   (student notebooks must run clean with nothing answered).
2. **Each notebook is graded in the same run** — one execution, two verdicts. After nbval's last
   cell, an extra item ``grade`` collects the bank's answer variables from nbval's live kernel
   exactly as ``python -m labkit grade`` does, and scores them with the bank's key and checkers
   here, in pytest's process (the lab's own notebooks are trusted, so no checker process is
   started for them; an exercise its check cell already scored on the same function keeps
   that Score: :func:`labkit.grading.grader.grade_lesson_kernel`): a solved notebook must
   score full marks, an untouched student notebook zero. (The grader's own path — fresh
   kernel, time limits, the checker process, hostile submissions — is tested on small
   notebooks in ``tests/grading/test_grade.py``.)
3. **Each solved notebook leaves an executed copy**, the reference run a learner compares
   with. nbval keeps what the kernel sent for each cell in ``IPyNbCell.test_outputs``
   (streams, results, PNG figures, errors); after a ``solutions/`` notebook's last item (its
   ``grade`` item, in the process that ran its cells: one xdist worker under ``--dist
   loadfile``), the notebook is written with those outputs to ``build/executed/NN_name.ipynb``
   under pytest's rootdir, headed by a markdown cell: when it ran, on what (OS, CPU, GPUs as
   the kernel's torch saw them), Python, torch, labkit's git commit, which cells failed. A
   notebook only partly run (``-k``, ``-x``) writes nothing, so a partial run never replaces a
   whole one. Each code cell's run time is kept in its ``metadata.labkit.seconds`` (what
   ``python -m labkit minutes`` reads, :mod:`labkit.grading.minutes`). ``python -m labkit
   site`` renders the copies (:mod:`labkit.grading.site`).
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import pytest

_FOLDERS = ("solutions", "notebooks")
EXECUTED = Path("build") / "executed"     # the executed copies, under pytest's rootdir


def _lesson_folder(path: Path) -> str | None:
    return path.parent.name if path.suffix == ".ipynb" and path.parent.name in _FOLDERS else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _lesson_folder(Path(str(item.fspath))) == "solutions":
        os.environ["LABKIT_EXPECT_SOLVED"] = "1"
        if hasattr(item.parent, "kernel"):      # nbval's notebook: its run starts or goes on
            _RUNS.setdefault(item.parent.nodeid, _Run())
    else:
        os.environ.pop("LABKIT_EXPECT_SOLVED", None)


def pytest_collection_modifyitems(session, config, items):
    """Put a ``grade`` item right after the last cell of every lesson notebook."""
    out, last = [], {}
    for item in items:
        out.append(item)
        if _lesson_folder(Path(str(item.fspath))) and hasattr(item.parent, "kernel"):
            last[item.parent] = len(out)
    for parent, index in sorted(last.items(), key=lambda kv: -kv[1]):
        out.insert(index, GradeItem.from_parent(parent, name="grade"))
    items[:] = out


class GradeItem(pytest.Item):
    """Score the answers left in nbval's kernel with the grader's own key."""

    def runtest(self):
        from .grader import Options, grade_lesson_kernel

        nbfile, path = self.parent, Path(str(self.fspath))
        kernel = nbfile.kernel
        if kernel is None or not kernel.is_alive():
            pytest.fail("the notebook's kernel is gone: it cannot be graded")

        def run_cell(source):
            kernel.await_idle(kernel.execute_cell_input(source), Options().collect_timeout)

        scores, problem = grade_lesson_kernel(nbfile.nb, path, run_cell,
                                              solved=_lesson_folder(path) == "solutions")
        self.user_properties.append(("points", sum(s.points for s in scores)))
        assert problem is None, problem

    def reportinfo(self):
        return self.fspath, 0, f"{self.parent.name}::grade"


# --- 3. the executed copy of a solved notebook ---------------------------------------------------

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@dataclass
class _Run:
    """A solved notebook's run so far, in the process that runs its cells."""

    start: datetime.datetime = field(default_factory=lambda: datetime.datetime.now().astimezone())
    outputs: dict = field(default_factory=dict)   # code cell number -> nbval's outputs, or None
    failed: list = field(default_factory=list)    # the items that failed: "Cell 3", "grade"
    seconds: dict = field(default_factory=dict)   # code cell number -> how long it ran


_RUNS: dict[str, _Run] = {}                       # the notebook's node id -> its run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    run = _RUNS.get(getattr(item.parent, "nodeid", None))
    if run is not None and (call.when == "call" or report.failed):
        if hasattr(item, "test_outputs"):         # nbval's IPyNbCell: None if it did not run
            run.outputs[item.cell_num] = item.test_outputs
            if call.when == "call":
                run.seconds[item.cell_num] = round(call.duration, 2)
        if report.failed and item.name not in run.failed:
            run.failed.append(item.name)
    return report


@pytest.hookimpl(tryfirst=True)     # before the runner's teardown stops the notebook's kernel
def pytest_runtest_teardown(item, nextitem):
    nbfile = item.parent
    run = _RUNS.get(getattr(nbfile, "nodeid", None))
    if run is None or (nextitem is not None and nextitem.parent is nbfile):
        return
    del _RUNS[nbfile.nodeid]
    if len(run.outputs) == sum(cell.cell_type == "code" for cell in nbfile.nb.cells):
        write_executed(nbfile, run, Path(item.config.rootpath) / EXECUTED)


def write_executed(nbfile, run: _Run, folder: Path) -> Path:
    """``folder/NN_name.ipynb``: the notebook with this run's outputs, headed by when and where
    it ran. A code cell's execution count is its number among the code cells (from 1); a cell
    that did not run has none."""
    import nbformat

    from .gradescope import repo_commit
    nb = copy.deepcopy(nbfile.nb)
    widgets = 0
    for num, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        outs = run.outputs[num]
        cell.execution_count = None if outs is None else num + 1
        cell.outputs = [nbformat.from_dict(copy.deepcopy(out)) for out in outs or ()]
        if num in run.seconds:                    # the section minutes read it (grading.minutes)
            cell.metadata.setdefault("labkit", {})["seconds"] = run.seconds[num]
        for out in cell.outputs:
            if out.output_type == "execute_result":
                out.execution_count = num + 1
            data = out.get("data", {})
            if data.pop(WIDGET_VIEW, None) is not None:   # no widget state is saved: no page
                widgets += 1                               # could show it; its fallback stays
                if set(data) <= {"text/plain"}:
                    data["text/plain"] = ("[an interactive widget: it works only in a live "
                                          "notebook, and nothing of it is saved here]")
    end = datetime.datetime.now().astimezone()
    name = Path(str(nbfile.fspath)).name
    commit = repo_commit(Path(__file__).resolve().parents[2])
    info = {"notebook": f"solutions/{name}", "start": run.start.isoformat(timespec="seconds"),
            "end": end.isoformat(timespec="seconds"), **_machine(nbfile.kernel),
            "labkit_commit": commit and commit[:12],
            "failed": [f"In [{int(f.split()[1]) + 1}]" if f.startswith("Cell ") else f"`{f}` item"
                       for f in run.failed],
            "widgets": widgets}
    header = nbformat.v4.new_markdown_cell(header_text(info))
    header.metadata["labkit"] = {"executed": info}
    nb.cells.insert(0, header)
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / name, folder / f".{name}.{os.getpid()}.tmp"
    nbformat.write(nb, str(tmp))
    os.replace(tmp, path)                         # never a half-written copy
    return path


def header_text(info: dict) -> str:
    """The markdown that heads an executed copy: when, where and with what it ran, what failed."""
    start = datetime.datetime.fromisoformat(info["start"])
    end = datetime.datetime.fromisoformat(info["end"])
    offset = end.strftime("%z")                   # +0100: the zone's name, if any, then UTC+01:00
    zone = " ".join(filter(None, [end.strftime("%Z"), f"(UTC{offset[:3]}:{offset[3:]})"]))
    gpus = info["gpus"]
    gpu = ("unknown (the notebook's kernel could not be asked)" if gpus is None else
           "none (`torch.cuda.is_available()` was False in the notebook's kernel)" if not gpus else
           f"{len(gpus)} × {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus))
    cpus = f"{info['cpus']} logical CPUs" + (f" ({info['usable_cpus']} usable by the run)"
                                             if info["usable_cpus"] != info["cpus"] else "")
    commit = (f"commit `{info['labkit_commit']}` (the checkout's HEAD; uncommitted changes, if "
              "any, are not recorded)" if info["labkit_commit"] else "(no git commit found)")
    failed = (", ".join(info["failed"]) + " (a failed cell's error is its last output)"
              if info["failed"] else "none")
    lines = [
        f"> **Executed copy: every output below comes from one run** of `{info['notebook']}` "
        "by the lab's tests (pytest with nbval: one kernel, top to bottom). The notebook "
        "itself is committed without outputs; numbers, timings and plots from another machine "
        "or another run will differ.",
        ">",
        f"> - **When:** {start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} {zone}",
        f"> - **Where:** {info['os']}; CPU: {info['cpu']}, {cpus}; GPU: {gpu}",
        f"> - **With:** Python {info['python']}, torch {info['torch']}, labkit {commit}",
        f"> - **Failed:** {failed}",
    ]
    if info["widgets"]:
        lines.append(f"> - **Widgets:** {info['widgets']} interactive widget(s) ran live only; "
                     "each shows here the picture or text it offered in its place")
    return "\n".join(lines)


_ASK_KERNEL = '''def __labkit_machine__(out):
    import json, platform
    found = {"python": platform.python_version()}
    try:
        import torch
        found["torch"] = torch.__version__
        found["gpus"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if torch.cuda.is_available() else [])
    except Exception:
        pass
    with open(out, "w") as f:
        json.dump(found, f)
__labkit_machine__(%r)
del __labkit_machine__
'''


def _machine(kernel) -> dict:
    """OS, CPU and CPU count from this process (the same machine); Python, torch and the GPUs
    from the notebook's kernel, which ran the cells (CUDA is never started in pytest's process:
    it forks ranks). If the kernel cannot be asked: torch's installed version, GPUs unknown."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "(not installed)"
    found = {"os": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
             "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count(), "python": platform.python_version(), "torch": torch,
             "gpus": None}
    if kernel is not None and kernel.is_alive():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "machine.json"
            try:
                kernel.await_idle(kernel.execute_cell_input(_ASK_KERNEL % str(out),
                                                            allow_stdin=False), 30)
                found.update(json.loads(out.read_text()))
            except (Empty, OSError, ValueError):
                pass
    return found
