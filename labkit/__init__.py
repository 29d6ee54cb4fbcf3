"""labkit: the engine of the lab "Distributed Training: DDP, Gradient Sync, and Multi-GPU".

Notebooks use one import and a few verbs::

    import labkit as lk
    res = lk.run(step, world_size=4)   # step(rank, world_size) on 4 real ranks
    res.values, res.stdout, res.wall_s

Importing labkit is cheap: torch is imported by the ranks, and in the notebook
only when a verb needs it. In a Jupyter kernel the import also starts the rank
launcher in the background (one process that imports torch once and forks
ranks from then on), so the first ``lk.run`` answers in about a second;
``LABKIT_PRESTART=0`` turns that off. It ends with the kernel.
"""
import os as _os
import sys as _sys

from .errors import (BackendUnavailable, InvalidJob, JobFailed, JobTimeout, LabkitError,
                     RankCrashed, RankError, RemoteTraceback, ResultNotPicklable)
from .launch import MAX_WORLD_SIZE, run, shutdown, warmup
from .result import JobResult, RankResult

__all__ = [
    "run", "warmup", "shutdown", "diagnose", "JobResult", "RankResult", "MAX_WORLD_SIZE",
    "LabkitError", "InvalidJob", "BackendUnavailable", "JobFailed", "RankError",
    "ResultNotPicklable", "RankCrashed", "JobTimeout", "RemoteTraceback",
]
__version__ = "0.1.0"

# Lesson modules load on first use (``lk.collectives``, ``lk.quiz`` ...): one concept each.
_SUBMODULES = ("quiz", "exercise", "grade", "notebooks", "collectives", "ringviz", "bandwidth",
               "ddp", "ddp_check", "overlap", "timeline", "pipeline_check", "plots", "parallelism",
               "pitfalls", "diagnosis", "train", "torchrun", "stacks", "bench", "nccl_capture",
               "capstone")


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "diagnose":  # lk.diagnose(result): a verdict for a failed job (notebook 04)
        return importlib.import_module(f"{__name__}.diagnosis").diagnose
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


if ("ipykernel" in _sys.modules and _os.environ.get("LABKIT_PRESTART", "1") != "0"
        and "LABKIT_RANK_PROCESS" not in _os.environ):
    warmup()
