"""Lesson 08, the capstone: a small GPT trained under torchrun that survives failures, shards, and proves itself.

Modules, one concept each (the script imports only torch, these,
:mod:`labkit.portable.checkpoints`, the rotation and verification notebook 05 teaches, and
:mod:`labkit.portable.elastic`, its ``@record``, and :mod:`labkit.portable.ending`, how a rank
ends; plain Python, all three):

* :mod:`.data` — the corpus (Python's standard library, as bytes) and the per-rank batches;
* :mod:`.model` — a small byte-level GPT;
* :mod:`.evaluate` — distributed evaluation equal to one process (padding dropped, sums reduced);
* :mod:`.sharded_checkpoint` — model + optimizer + RNG with torch.distributed.checkpoint;
* :mod:`.train_gpt` — the script: ``python -m labkit.capstone.train_gpt`` or under torchrun.

Notebook 08 also reads the runs (:mod:`.runs`: per-step times, throughput, the sample) and
grades the exercise (:mod:`.check`: its runs, and the probes that run inside the learner's
workers); those are the lab's, not part of the project a learner copies.

Nothing is imported until used (``lk.capstone.train_gpt`` imports torch).
"""
import importlib as _importlib

_MODULES = ("data", "model", "evaluate", "sharded_checkpoint", "train_gpt", "runs", "check")
__all__ = list(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
