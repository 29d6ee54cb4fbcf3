"""The exercise checkers and quiz keys of notebook 04 (pitfalls).

Checkers grade by running: :func:`check_replica_training` runs the learner's repaired training
loop on real ranks and compares every replica with one process training on the whole batch;
:func:`check_staleness_lr` drives the delay-k simulation with the learner's learning-rate rule.
The quiz keys read the answer out of the learner's own runs (the mystery hang, the flight
recorder, the parameter server).
"""
from __future__ import annotations

from ..diagnosis import compare_fingerprints, compare_flight_records, diagnose
from ..grading.exercise import case
from ..runtime import run
from .divergence import oracle_fingerprint
from .scenario import Outcome
from .staleness import PSRun, delayed_sgd, mean_staleness

__all__ = ["check_replica_training", "check_staleness_lr", "mystery_stuck_rank",
           "mystery_collective", "flight_missing_seq", "async_mean_staleness"]


# ------------------------------------------------------------------ exercise checkers
def check_replica_training(fn) -> list:
    """Checker of exercise 04.fix_training: replicas identical AND equal to one-process training."""
    def on(world_size, steps):
        def test():
            res = run(fn, world_size, kwargs={"steps": steps}, timeout=5, deadline=20,
                      echo=False)
            v = diagnose(res)
            assert v.kind == "ok", f"replicas disagree after {steps} steps: {v.headline}"
            fp = res.values[0]
            assert hasattr(fp, "sums"), ("return lk.diagnosis.fingerprint(model) from every rank, "
                                         f"not {type(fp).__name__}")
            o = compare_fingerprints([oracle_fingerprint(steps), fp], 1e-5)
            assert o.ok, ("replicas agree with each other but not with one process training on the "
                          "whole batch: average the gradients (sum / world_size), don't just sum")
            return "identical replicas, equal to the one-process oracle"
        return test
    return [case(f"{n} ranks, {s} steps", on(n, s)) for n, s in ((2, 3), (3, 2))]


def check_staleness_lr(fn) -> list:
    """Checker of exercise 04.staleness_lr: ``fn(lr, staleness)`` must tame delays 0 to 16."""
    start = delayed_sgd(0, 1.0, 1)[0]

    def converges(k):
        def test():
            assert float(fn(1.0, 0)) == 1.0, (f"with staleness 0 keep the base rate: "
                                             f"fn(1.0, 0) returned {fn(1.0, 0)!r}")
            final = delayed_sgd(k, 1.0, 300, fn)[-1]
            assert final < 0.01, (f"with delay {k} the loss ends at {final:.3g} (it starts near "
                                  f"{start:.2g}): the step is still too large, or so small that "
                                  f"nothing is learned")
            return f"final loss {final:.4g}"
        return test
    return [case(f"delay {k}", converges(k)) for k in (0, 2, 4, 16)]


# ------------------------------------------------------------------ quiz keys
def mystery_stuck_rank(mystery) -> int:
    """Quiz key: the rank that held the others up in the learner's own mystery run."""
    v = diagnose(mystery)
    if v.kind != "missing_rank" or len(v.culprits) != 1:
        raise ValueError(f"this run did not hang on one rank ({v.kind}); run the mystery cell "
                         f"again")
    return v.culprits[0]


def mystery_collective(mystery) -> str:
    """Quiz key: the collective the other ranks were waiting in."""
    v = diagnose(mystery)
    if not v.collective:
        raise ValueError("no rank was inside a collective in this run; run the mystery cell again")
    return v.collective


def flight_missing_seq(fr: Outcome) -> int:
    """Quiz key: the first collective number the skipping rank never issued, from its records."""
    records = [v for v in fr.result.values if v is not None]
    v = compare_flight_records(records)
    if v.seq is None:
        raise ValueError(f"these flight records show no missing collective ({v.kind}); run the "
                         f"flight-recorder cell again")
    return v.seq


def async_mean_staleness(ps_async: PSRun) -> float:
    """Quiz key 04.mean_staleness: the mean staleness of the notebook's ``ps_async`` run."""
    return mean_staleness(ps_async)
