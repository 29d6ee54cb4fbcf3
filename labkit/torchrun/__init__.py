"""Notebook 05 — torchrun and fault tolerance: a training script that survives a crash.

* :mod:`~labkit.torchrun.train` — the lab's training script (a leaf: imports only torch,
  :mod:`labkit.portable.checkpoints`, :mod:`labkit.portable.elastic` and
  :mod:`labkit.portable.ending`):
  one process or DDP under torchrun, snapshots, bit-identical resume (``# [dist]`` marks the
  DDP delta);
* :mod:`~labkit.torchrun.ddp_spawn` / :mod:`~labkit.torchrun.ddp_torchrun` — one script
  started by ``mp.spawn``, then by torchrun: their diff is the lesson;
* :mod:`~labkit.torchrun.runs` — losses per attempt and resume steps read from a run's log;
* :mod:`~labkit.torchrun.check` — the exercise checker, its oracle, the reference run, the
  quiz key.

Launching torchrun from a notebook is the runtime's job (:mod:`labkit.runtime.torchrun`,
:mod:`labkit.runtime.torchrun.function`); ``lk.torchrun`` hands those verbs on too.
"""
from ..runtime.torchrun import (AGENT_ENV, Job, Line, Run, TorchrunError, TorchrunFailed,
                                TorchrunTimeout, command, launch, live_processes, run)
from ..runtime.torchrun.function import FunctionRun, run_function
from .check import reference
from .runs import losses, plot_losses, resumes

__all__ = ["launch", "run", "command", "Job", "Run", "Line", "live_processes", "run_function",
           "FunctionRun", "AGENT_ENV", "TorchrunError", "TorchrunTimeout", "TorchrunFailed",
           "losses", "resumes", "plot_losses", "reference"]
