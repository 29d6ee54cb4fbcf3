"""Claim tests: what notebook 07 says torch 2.13 / gloo do, reproduced on real ranks.

Each docstring names the notebook section and quotes the sentence it backs, in the format of
the team's claim tests (``07 "Section": “sentence”``); :func:`test_the_lab_says_what_these_tests_show`
checks that every quoted sentence is still in ``solutions/07_scaling.ipynb`` (tests/claims/_claims.py),
so prose and test cannot drift apart. When one fails after a torch upgrade, the sentence is wrong for the new
version: fix the prose, then the test.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest

import _claims
import labkit as lk
from labkit.scaling import hooks, knobs, pipeline, precision

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def _bf16_on_gloo(rank, world_size):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 4))
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as exc:
        return f"TypeError: {exc}"
    return "registered"


def test_bf16_hook_is_refused_by_a_cpu_build_whatever_the_backend():
    """07 "8 · Cutting the bytes": “On this CPU-only build of torch 2.13 `register_comm_hook`
    refuses it with a `TypeError` as soon as it is given: the check
    (`torch/nn/parallel/distributed.py`) asks whether torch was *built* with CUDA (or ROCm) and
    NCCL ≥ 2.10, or whether an XPU device is present with XCCL, never which backend the group
    uses, so a CUDA build accepts it on gloo too.”"""
    import torch

    got = lk.run(_bf16_on_gloo, 2, echo=False).values
    if torch.version.cuda is None and torch.version.hip is None:       # this lab's CPU wheel
        assert all(v.startswith("TypeError: BF16 all reduce communication hook required")
                   for v in got), got
    else:                          # a CUDA/ROCm build with NCCL >= 2.10: the same gloo group
        assert got == ["registered"] * 2, got


def test_fp16_and_powersgd_run_on_gloo_and_send_what_the_formulas_say():
    """07 "8 · Cutting the bytes": “Three all-reduces per PowerSGD step: the uncompressed vectors,
    then P, then Q (computed from the all-reduced P).”"""
    traced = hooks.traced_hook_steps(2, names=("allreduce", "fp16", "powersgd r=2"), steps=5,
                                     width=64, depth=3)
    fp32 = traced["grad_bytes"]
    assert traced["bytes"]["allreduce"][3:] == [fp32, fp32]
    assert traced["bytes"]["fp16"][3:] == [fp32 // 2, fp32 // 2]
    shapes = traced["shapes"]
    assert traced["bytes"]["powersgd r=2"][2:] == [hooks.powersgd_bytes(shapes, 2)] * 3
    step = [r for r in traced["trace"][0] if r["label"] == "powersgd r=2 step 4"]
    vectors = sum(s[0] for s in shapes if len(s) == 1) * 4
    p_bytes = sum(s[0] * 2 for s in shapes if len(s) == 2) * 4
    q_bytes = sum(s[1] * 2 for s in shapes if len(s) == 2) * 4
    assert [(r["kind"], r["bytes"]) for r in step] == [
        ("all_reduce", vectors), ("all_reduce", p_bytes), ("all_reduce", q_bytes)]


def test_autocast_keeps_fp32_master_weights_and_gradients():
    """07 "9 · Mixed precision": “the parameters stay float32, and so do their gradients and the
    optimizer.” and “autocast does not touch what DDP sends — the
    gradients are fp32 like the master weights —”"""
    prec = precision.compare_precision(steps=3, rounds=3, width=32, progress=False)
    rows = {r["mode"]: r for r in prec["rows"]}
    for mode in precision.MODES:
        assert rows[mode]["param_dtype"] == rows[mode]["grad_dtype"] == "torch.float32"
        assert rows[mode]["allreduce_bytes"] == rows["fp32"]["allreduce_bytes"] > 0
        assert rows[mode]["allreduce_bytes"] == rows[mode]["grad_bytes"]


def test_grad_scaler_is_dynamic_by_default():
    """07 "9 · Mixed precision": “The scale is dynamic: each overflow halves it, and after
    `growth_interval` = 2000 steps without one it doubles (`torch.amp.GradScaler`'s defaults).”"""
    import torch

    scaler = torch.amp.GradScaler("cpu")
    assert scaler.get_backoff_factor() == 0.5 and scaler.get_growth_factor() == 2.0
    assert scaler.get_growth_interval() == 2000


def test_find_unused_parameters_adds_one_all_reduce_and_the_bucket_view_drops_a_copy():
    """07 "10 · DDP knobs that matter": “The trace shows what `find_unused_parameters=True` costs
    beyond time: **one more all-reduce per step**” and “without it DDP keeps every gradient twice,
    in `.grad` and in its flat bucket; with it `.grad` is a view into the bucket.”"""
    settings = {k: knobs.SETTINGS[k] for k in ("default (bucket_cap_mb=25)",
                                               "find_unused_parameters=True")}
    res = knobs.measure_knobs(settings=settings, steps=3, rounds=3, width=32, depth=2,
                              progress=False)
    calls = {r["setting"]: (r["allreduces"], r["allreduce_bytes"]) for r in res["rows"]}
    (base_n, base_b), (unused_n, unused_b) = calls.values()
    assert base_n == 1 and unused_n == 2 and 0 < unused_b - base_b < 200   # a small map
    mem = res["memory"]
    assert mem[False]["bytes_per_param"] == pytest.approx(12.0)          # params, grads, bucket
    assert mem[True]["bytes_per_param"] == pytest.approx(8.0) and mem[True]["grads_are_views"]
    assert not mem[False]["grads_are_views"]


def test_pipeline_schedules_run_on_gloo_and_hold_the_activations_the_formulas_say():
    """07 "11 · Pipeline schedules: GPipe, 1F1B, interleaved": “The activation counts follow the
    formulas (GPipe's stages hold all m, 1F1B's first stage p).”"""
    pipe = pipeline.measure_pipeline(world_size=2, micro_batches=4, width=32, blocks=1,
                                     batch_size=16, steps=1, progress=False)
    rows = {r["schedule"]: r for r in pipe["rows"]}
    assert set(rows) == set(pipeline.SCHEDULES)
    assert round(rows["GPipe"]["peak_mb"][0]) == 4 and round(rows["1F1B"]["peak_mb"][0]) == 2
    assert round(rows["1F1B"]["peak_mb"][1]) == 1
    assert all(0.0 <= r["bubble"] < 1.0 for r in rows.values())


def _modes_see_every_op(rank, world_size):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.namespace)
            return func(*args, **(kwargs or {}))
    with Watch():
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum()
    return sorted(set(seen))


def test_a_dispatch_mode_sees_every_torch_op():
    """07 "2 · See every collective: `lk.run(..., trace=True)`": “while it is on, *every* torch
    operation of the rank passes through Python, so expect compute to get slower.”"""
    assert lk.run(_modes_see_every_op, 1, echo=False).values[0] == ["aten"]


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
