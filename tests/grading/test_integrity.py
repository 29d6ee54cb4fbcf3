"""The process-wide census (labkit.grading.integrity): state an answer hides anywhere is counted.

In-process (no ranks): each test makes a baseline, hides 1000 fp32 elements one way, and checks
that :meth:`Census.held` sees at least their 4000 bytes, that what ``exclude`` names is left
out, and that the library and optimizer censuses find objects however they are referred to.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from labkit.grading.integrity import LIBRARY, Census, CensusError

N = 1000                      # elements hidden by each test
BYTES = 4 * N


def _held(make) -> int:
    """Bytes the census sees while ``make()``'s return value is alive (baseline before it)."""
    with Census() as census:
        keep = make()
        got = census.held(exclude=[]).total
        del keep
    return got


def test_a_tensor_in_a_closure_is_counted():
    def make():
        full = torch.randn(N)
        return lambda: full
    assert _held(make) >= BYTES


def test_a_tensor_in_a_default_argument_a_class_attribute_and_a_tensor_attribute():
    def make():
        def f(x, _keep=torch.randn(N)):
            return x
        cls = type("Hider", (), {"kept": torch.randn(N)})
        decoy = torch.zeros(1)
        decoy.hidden = torch.randn(N)
        return f, cls, decoy
    assert _held(make) >= 3 * BYTES


def test_a_small_view_counts_its_whole_storage():
    assert _held(lambda: torch.randn(N)[:1]) >= BYTES


def test_a_tensor_saved_in_a_kept_autograd_graph_is_counted():
    def make():
        w = torch.randn(N, requires_grad=True)
        out = (w * 2).sum()
        del w
        return out.grad_fn              # only the graph holds w now
    assert _held(make) >= BYTES


def test_state_hidden_in_the_grad_of_an_expanded_decoy_is_counted():
    def make():
        decoy = torch.zeros(1).expand(N).requires_grad_()
        decoy.grad = torch.randn(N)
        return decoy
    assert _held(make) >= BYTES - 4


def test_numpy_arrays_bytes_and_python_floats_are_counted():
    assert _held(lambda: [np.random.randn(N).astype(np.float32)]) >= BYTES
    data = torch.randn(N).numpy().tobytes()
    assert _held(lambda: (lambda kept={"b": bytes(data)}: kept)) >= BYTES   # dict untracked
    assert _held(lambda: torch.randn(N).tolist()) >= BYTES
    assert _held(lambda: (lambda kept=tuple(torch.randn(N).tolist()): kept)) >= BYTES


def test_what_the_checker_excludes_is_left_out_but_a_larger_storage_is_not():
    with Census() as census:
        model = torch.nn.Linear(100, 10)
        x = torch.randn(8, 100)
        records = [{"out": torch.randn(N)}]
        assert census.held(exclude=[model, x, records]).total < 200
        view = torch.randn(N)[:10]           # allowed its 10 elements, not the storage's 1000
        assert census.held(exclude=[model, x, records, view]).total >= BYTES - 40


def test_what_existed_before_the_baseline_is_not_counted():
    before = torch.randn(N)
    with Census() as census:
        assert census.held().total < BYTES
    del before


def test_a_library_object_in_a_closure_and_a_full_optimizer_are_found():
    with Census() as census:
        params = [torch.nn.Parameter(torch.randn(N))]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        params[0].grad = torch.ones(N)
        opt.step()
        DeviceMesh = type("DeviceMesh", (), {})           # a class by that name, in a closure
        hidden = (lambda m=DeviceMesh(): m)
        assert "DeviceMesh" in census.instances(LIBRARY)
        assert ("SGD", N) in census.optimizers()
        del hidden, opt


def test_an_answer_that_freezes_the_collector_makes_the_census_refuse():
    with Census() as census:
        gc.freeze()
        try:
            with pytest.raises(CensusError, match="cannot be verified"):
                census.held()
        finally:
            gc.unfreeze()
