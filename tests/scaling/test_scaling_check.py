"""The compression-hook checker: the right hook passes every case; each lazy or wrong answer fails
the case named for its mistake, and each class of shortcut (hidden state, the library, a copied
oracle, side channels: another thread, the process group's store, a file; no compression) fails
a case whose message names it; a stub is "not done"."""
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
FP16, ROUTE = "is a float16 value", "what the fp16 all-reduce of the shares gave"
BY_HAND = "written by hand"


def verdicts(fn) -> dict[str, bool]:
    return {c.name: c.passed for c in check_compress_hook(fn)}


def failing(fn) -> set[str]:
    return {name for name, ok in verdicts(fn).items() if not ok}


def named(cases: set[str], what: str) -> bool:
    return any(what in name for name in cases)


def details(fn) -> dict[str, str]:
    """Failing case name -> its message."""
    return {c.name: c.detail for c in check_compress_hook(fn) if not c.passed}


def says(bad: dict[str, str], case: str, *words: str) -> bool:
    """Both world sizes fail ``case``, each with a message holding every one of ``words``."""
    hits = [detail for name, detail in bad.items() if case in name]
    return len(hits) == 2 and all(w in d for d in hits for w in words)


def test_the_solution_passes_every_case_on_2_and_3_ranks():
    got = verdicts(answers.fp16_hook)
    assert len(got) == 13 and all(got.values()), got
    assert {n.split(":")[0] for n in got if ":" in n} == {"2 ranks", "3 ranks"}


def test_no_compression_fails_the_bytes_and_the_fp16_route_and_nothing_else():
    bad = details(answers.no_compression)
    assert says(bad, BYTES, "compress before sending", "float32 26720 B")
    assert says(bad, FP16, "float32 on the wire") and says(bad, ROUTE, "float32 on the wire")
    assert len(bad) == 6, bad


# ---------------------------------------------------- shortcuts: each fails a case that names it
def test_hidden_state_a_result_kept_from_an_earlier_call_is_named():
    bad = details(answers.kept_from_an_earlier_call)
    assert says(bad, ROUTE, "not what its float16 all-reduce produced", "kept from an earlier call")


def test_a_copied_oracle_the_checkers_own_data_and_teacher_is_named():
    bad = details(answers.copied_oracle)            # passes the gradient, bytes and fp16 cases
    assert says(bad, ROUTE, "carried 0 values", "all_gather", "data taken from the checker")


def test_side_channel_an_fp32_all_reduce_from_a_helper_thread_is_counted_and_named():
    bad = details(answers.helper_thread)
    assert says(bad, BYTES, "all_reduce float32 26720 B from 'Thread-")
    assert says(bad, FP16, "another thread") and says(bad, ROUTE, "from 'Thread-")


def test_side_channel_gradients_through_the_process_groups_store_are_named():
    bad = details(answers.through_the_store)
    assert says(bad, FP16, "the process group's store")
    assert says(bad, ROUTE, "carried 1 values", "the process group's store")


def test_side_channel_gradients_through_a_file_rounded_to_fp16_are_named():
    bad = details(answers.through_a_file)           # rounded: passes the fp16-value case
    assert set(bad) == {f"{n} ranks: the gradients are {ROUTE}" for n in (2, 3)}, bad
    assert says(bad, ROUTE, "carried 0 values", "a file")


@pytest.mark.parametrize("answer", ["summed", "divided_twice"])
def test_wrong_averaging_fails_the_gradient_case(answer):
    bad = failing(getattr(answers, answer))
    assert named(bad, GRAD) and not named(bad, BYTES)


def test_calling_torchs_own_hook_fails_every_case_and_names_it_in_the_last():
    """Before, torch's hook failed only the last case and scored 12 of 13 cases' points."""
    cases = check_compress_hook(answers.library)
    bad = {c.name: c.detail for c in cases if not c.passed}
    assert len(bad) == len(cases), bad
    assert bad["written by hand (not torch's fp16_compress_hook)"].startswith(
        "your hook called torch's")
    assert all("did the work" in d for name, d in bad.items() if not name.startswith("written")), \
        bad


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
