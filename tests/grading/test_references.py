"""labkit.grading.references: the lab's own implementations are counted where they run."""
from __future__ import annotations

import inspect
import pickle
import threading

import cloudpickle

import labkit as lk
from labkit.grading.references import reference_problem, references_used


def test_a_marked_reference_reads_and_pickles_like_the_function_it_marks():
    ring = lk.collectives.ring_all_reduce
    assert ring.__name__ == "ring_all_reduce" and "ring" in ring.__doc__
    assert list(inspect.signature(ring).parameters) == ["tensor", "op", "trace"]
    assert not hasattr(ring, "__wrapped__")      # no uncounted way in
    for dumps in (pickle.dumps, cloudpickle.dumps):   # by reference: the counted one comes back
        assert pickle.loads(dumps(ring)) is ring


def test_calls_in_the_block_are_named_from_any_thread_and_calls_outside_are_not():
    import torch

    try:
        lk.collectives.ring_all_reduce(torch.ones(2))    # before the block: counted, not named
    except Exception:
        pass
    with references_used("labkit.collectives.") as used, \
            references_used("labkit.ddp.") as elsewhere:
        worker = threading.Thread(target=_call_refusing, args=(lk.collectives.naive_all_reduce,))
        worker.start()
        worker.join()
    assert used == ["labkit.collectives.allreduce.naive_all_reduce"]
    assert elsewhere == []           # an exercise forbids its own lesson's references only
    assert "lk's collectives.allreduce.naive_all_reduce ran inside your answer" in \
        reference_problem(used)
    with references_used("labkit.") as nothing:
        pass
    assert nothing == [] and reference_problem(nothing) is None


def _call_refusing(fn):
    import torch
    try:
        fn(torch.ones(2))          # counted on entry, then refused: no process group here
    except Exception:
        pass
