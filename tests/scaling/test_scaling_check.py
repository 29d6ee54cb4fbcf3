"""The compression-hook checker: the right hook passes every case; each lazy or wrong answer fails
the case named for its mistake; a stub is "not done"."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import hook_answers as answers
from labkit.grading.exercise import NotDone
from labkit.scaling.check import check_compress_hook

cloudpickle.register_pickle_by_value(answers)           # ranks get the answers by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)

GRAD, BYTES, REPLICAS, TRAINS = ("gradients equal", "at most half the fp32 bytes",
                                 "replicas stay identical", "still trains")
BY_HAND = "written by hand"


def verdicts(fn) -> dict[str, bool]:
    return {c.name: c.passed for c in check_compress_hook(fn)}


def failing(fn) -> set[str]:
    return {name for name, ok in verdicts(fn).items() if not ok}


def named(cases: set[str], what: str) -> bool:
    return any(what in name for name in cases)


def test_the_solution_passes_every_case_on_2_and_3_ranks():
    got = verdicts(answers.fp16_hook)
    assert len(got) == 9 and all(got.values()), got
    assert {n.split(":")[0] for n in got if ":" in n} == {"2 ranks", "3 ranks"}


def test_no_compression_fails_the_bytes_and_only_the_bytes():
    bad = failing(answers.no_compression)
    assert bad and all(BYTES in name for name in bad)
    assert named(bad, "2 ranks") and named(bad, "3 ranks")


@pytest.mark.parametrize("answer", ["summed", "divided_twice"])
def test_wrong_averaging_fails_the_gradient_case(answer):
    bad = failing(getattr(answers, answer))
    assert named(bad, GRAD) and not named(bad, BYTES)


def test_calling_torchs_own_hook_fails_by_hand():
    assert failing(answers.library) == {"written by hand (not torch's fp16_compress_hook)"}


def test_doing_nothing_fails_gradients_bytes_and_replicas():
    bad = failing(answers.do_nothing)
    assert named(bad, GRAD) and named(bad, BYTES) and named(bad, REPLICAS)


def test_a_stub_is_not_done_and_a_hook_without_a_future_is_named():
    with pytest.raises(NotDone):
        check_compress_hook(answers.stub)

    def no_future(state, bucket):
        return bucket.buffer()
    [case] = check_compress_hook(no_future)
    assert not case.passed and "not a torch.futures.Future" in case.detail
