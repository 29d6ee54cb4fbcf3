"""labkit: the engine of the lab "Distributed Training: DDP, Gradient Sync, and Multi-GPU".

Notebooks use one import and a few verbs::

    import labkit as lk
    res = lk.run(step, world_size=4)   # step(rank, world_size) on 4 real ranks
    res.values, res.stdout, res.wall_s

The package's layout is the syllabus (:mod:`labkit.syllabus`: the lessons in order, one line
each): :mod:`labkit.runtime` runs ranks and owns every process the lab starts;
:mod:`labkit.grading` scores quizzes and exercises; :mod:`labkit.diagnosis` reads failed jobs;
:mod:`labkit.common` holds what every lesson shares; then one subpackage per lesson, each with
its content modules and a ``check/`` package for its exercise checkers. A lesson imports only the
layers below it and earlier lessons' shared pieces, never a later lesson.

Importing labkit is cheap: torch is imported by the ranks, and in the notebook only when a
verb needs it. Lesson handles (``lk.ddp``, ``lk.quiz`` ...) load on first use. In a Jupyter
kernel the import also starts the rank launcher in the background (one process that imports
torch once and forks ranks from then on), so the first ``lk.run`` answers in a couple of
seconds when it runs right away (Run All) and at once a few seconds later;
``LABKIT_PRESTART=0`` turns that off. It ends with the kernel.
"""
import os as _os
import sys as _sys

from .runtime import (MAX_WORLD_SIZE, BackendUnavailable, InvalidJob, JobFailed, JobResult,
                      JobTimeout, LabkitError, RankCrashed, RankError, RankResult,
                      RemoteTraceback, ResultNotPicklable, UnsupportedPlatform, run, shutdown,
                      warmup)

from .syllabus import handles as _handles

# The notebooks' handles: ``lk.<handle>`` -> the module it names (loaded on first use).
HANDLES = _handles()

__all__ = ["run", "warmup", "shutdown", "diagnose", "JobResult", "RankResult", "MAX_WORLD_SIZE",
           "LabkitError", "InvalidJob", "UnsupportedPlatform", "BackendUnavailable", "JobFailed",
           "RankError", "ResultNotPicklable", "RankCrashed", "JobTimeout", "RemoteTraceback",
           *HANDLES]
__version__ = "0.1.0"


def __getattr__(name: str):
    import importlib

    if name in HANDLES:
        return importlib.import_module(f"{__name__}.{HANDLES[name]}")
    if name == "diagnose":  # lk.diagnose(result): a verdict for a failed job (notebook 04)
        return importlib.import_module(f"{__name__}.diagnosis").diagnose
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if ("ipykernel" in _sys.modules and _os.environ.get("LABKIT_PRESTART", "1") != "0"
        and "LABKIT_RANK_PROCESS" not in _os.environ):
    warmup()
