"""Where is a hung rank stuck? Reading Python stack dumps of live ranks.

When a job passes its deadline, labkit asks every live rank for a stack dump
(``faulthandler`` on SIGUSR1, which works even while the rank is blocked inside
a C++ collective) before killing it. This module turns that dump into the
frames of the rank's main thread and a one-line answer such as
``all_reduce, called from step (line 5: dist.all_reduce(t))`` — the same first
question ml-engineering's hang playbook answers with py-spy on every rank.
"""
from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass

__all__ = ["Frame", "parse_stack", "where_stuck"]

_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')
_RUNNER_FILE = os.path.join("labkit", "runtime", "zygote.py")
_C10D_FILES = ("distributed_c10d.py",)
_TORCH_DIR = os.sep + "torch" + os.sep


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def source(self) -> str:
        """The source line, when the parent can see it (notebook cells included)."""
        line = linecache.getline(self.file, self.line).strip()
        return line.split("  #")[0].rstrip()  # the code, not its comment


def parse_stack(dump: str) -> list[Frame]:
    """Frames of the thread that runs the job, innermost first.

    A faulthandler dump lists every thread; the job's thread is the one whose
    frames pass through the runner's ``_run_job``. Runner frames are dropped.
    """
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if "(most recent call first)" in line:
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    for frames in threads:
        if any(f.file.endswith(_RUNNER_FILE) and f.func == "_run_job" for f in frames):
            return [f for f in frames if not f.file.endswith(_RUNNER_FILE)]
    return threads[0] if threads else []


def where_stuck(frames: list[Frame]) -> str:
    """One line: the collective a rank is blocked in (if any) and the caller's code."""
    if not frames:
        return "no Python frames (the rank was between jobs or in native code)"
    user = next((i for i, f in enumerate(frames) if _TORCH_DIR not in f.file), None)
    if user is None:
        f = frames[0]
        return f"{f.func} ({os.path.basename(f.file)}:{f.line})"
    caller = frames[user]
    collective = next((f.func for f in reversed(frames[:user])
                       if f.file.endswith(_C10D_FILES)), None)
    src = caller.source
    at = f"line {caller.line}: {src}" if src else f"{os.path.basename(caller.file)}:{caller.line}"
    if collective:
        return f"{collective}, called from {caller.func} ({at})"
    return f"{caller.func} ({at})"
