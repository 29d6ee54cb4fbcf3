"""Notebook 05 — torchrun and fault tolerance: a training script that survives a crash.

* :mod:`~labkit.torchrun.train` — the lab's training script (a leaf: imports only torch,
  :mod:`labkit.portable.checkpoints`, :mod:`labkit.portable.elastic` and
  :mod:`labkit.portable.ending`):
  one process or DDP under torchrun, snapshots, bit-identical resume (``# [dist]`` marks the
  DDP delta);
* :mod:`~labkit.torchrun.ddp_spawn` / :mod:`~labkit.torchrun.ddp_torchrun` — one script
  started by ``mp.spawn``, then by torchrun: their diff is the lesson;
* :mod:`~labkit.torchrun.entry` — the core build's entry point (``torchrun_main``: read
  ``RANK``/``WORLD_SIZE``, join the group from torchrun's environment, leave it) launched from
  a notebook cell (``launch_main``; the worker script is :mod:`~labkit.torchrun.script`), and a
  job's log with only the lines worth reading (``follow``, ``wait``);
* :mod:`~labkit.torchrun.runs` — losses per attempt and resume steps read from a run's log;
* :mod:`~labkit.torchrun.check` — the exercise checkers (``05.torchrun_lines``,
  ``05.train_ddp``), the DDP exercise's oracle, the reference run, the quiz key.

Launching torchrun from a notebook is the runtime's job (:mod:`labkit.runtime.torchrun`,
:mod:`labkit.runtime.torchrun.function`); ``lk.torchrun`` hands those verbs on too.
"""
from ..runtime.torchrun import (AGENT_ENV, Job, Line, Run, TorchrunError, TorchrunFailed,
                                TorchrunTimeout, command, launch, live_processes, run)
from ..runtime.torchrun.function import FunctionRun, run_function
from .check import reference
from .entry import follow, launch_call, launch_main, torchrun_main, train_body, wait
from .runs import losses, plot_losses, resumes

__all__ = ["launch", "run", "command", "Job", "Run", "Line", "live_processes", "run_function",
           "FunctionRun", "AGENT_ENV", "TorchrunError", "TorchrunTimeout", "TorchrunFailed",
           "losses", "resumes", "plot_losses", "reference", "torchrun_main", "train_body",
           "launch_main", "launch_call", "follow", "wait"]
