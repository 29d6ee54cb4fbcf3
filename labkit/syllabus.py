"""The syllabus: the lessons in order, each with its notebook, its code and its handles.

One ordered list that the rest reads:

* the package face builds ``lk.<handle>`` from it (:data:`labkit.HANDLES`);
* the house test takes its layers from it (a lesson imports the engine and earlier lessons,
  never a later one);
* the tests check that every lesson has its student notebook, its solution and its question
  bank, under the same name, and that the README maps them in this order.

Adding a lesson is one folder (``labkit/<package>/``, with a ``check/`` for its exercises)
and one line in :data:`LESSONS`. Nothing here imports the rest of the package.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Lesson", "LESSONS", "ENGINE", "ENGINE_HANDLES", "LAYERS", "handles"]


@dataclass(frozen=True)
class Lesson:
    """One lesson: ``notebook`` is the name its student notebook (``notebooks/``), solution
    (``solutions/``) and question bank (``quizzes/``) share; ``package`` the folder of its code
    under ``labkit/`` (None: it uses the engine only); ``handles`` what it adds to ``lk``
    (handle -> module under ``labkit``, loaded on first use)."""

    notebook: str
    package: str | None
    handles: dict[str, str] = field(default_factory=dict)

    @property
    def number(self) -> str:
        """The two digits that start the notebook's name and its question ids ("03")."""
        return self.notebook[:2]


# The engine, lowest layer first: the plain files the learner's projects take with them, then
# what runs ranks and owns processes, holds what every lesson shares, grades, and reads failed
# jobs. Every lesson may use all of it.
ENGINE = ("portable", "runtime", "common", "grading", "diagnosis")
ENGINE_HANDLES = {"quiz": "grading.quiz", "exercise": "grading.exercise", "plots": "common.plots"}

LESSONS = (
    Lesson("00_setup", None),
    Lesson("01_data_vs_model_parallelism", "data_vs_model", {"data_vs_model": "data_vs_model"}),
    Lesson("02_ddp_step_by_step", "ddp", {"ddp": "ddp", "overlap": "ddp.overlap"}),
    Lesson("03_ring_allreduce", "collectives", {"collectives": "collectives",
                                                "ringviz": "collectives.player",
                                                "bandwidth": "collectives.bandwidth"}),
    Lesson("04_pitfalls", "pitfalls", {"pitfalls": "pitfalls", "diagnosis": "diagnosis",
                                       "nccl_capture": "pitfalls.nccl_capture"}),
    Lesson("05_torchrun", "torchrun", {"torchrun": "torchrun", "train": "torchrun.train"}),
    Lesson("06_sharding", "sharding", {"sharding": "sharding"}),
    Lesson("07_scaling", "scaling", {"scaling": "scaling"}),
    Lesson("08_capstone", "capstone", {"capstone": "capstone"}),
    Lesson("09_sequences_and_experts", "sequences_experts",
           {"sequences_experts": "sequences_experts"}),
)

# The package's layers, lowest first: this module, the engine, then the lessons in order.
LAYERS = ("syllabus", *ENGINE, *(les.package for les in LESSONS if les.package))


def handles() -> dict[str, str]:
    """Every ``lk.<handle>``: the engine's, then each lesson's, in order."""
    out = dict(ENGINE_HANDLES)
    for les in LESSONS:
        out.update(les.handles)
    return out

