"""Claim tests for notebook 09's context-parallel sections (ring attention, Ulysses, PyTorch's
``context_parallel``): each reproduces, on the pinned torch 2.13.0 and gloo, a sentence the
notebook says about torch. The docstring names the section and quotes the sentence; the last
test checks that every quoted sentence is still in solutions/09_*.ipynb. When one fails after a
torch upgrade, the sentence is wrong for the new version: fix the prose, then the test.

What ``torch.distributed.tensor.experimental.context_parallel`` does on CPU/gloo, tried on 2
ranks with SDPA (``[1, 2, 16, 8]`` q, k, v, sharded on dim 2), is what the first three tests
pin: on a CPU tensor SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which is
not one of the kernels context parallelism replaces with its ring (CUDA's flash, memory-
efficient and cuDNN attention). Causal, DTensor finds no sharding for it and raises. Not causal,
DTensor derives a sharding by tracing that kernel's decomposition on every combination of input
placements, which took about 70 s of one core on the first call here (the second call: 0.5 s,
cached), and returns the right rows; that run is too slow for every test run, so it is opt-in:
``LABKIT_SLOW_CLAIMS=1``.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch

import _claims
import labkit as lk

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)
CPU_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _cp_job(rank, world_size, causal):
    """context_parallel around one SDPA call; this rank's rows against the one-process SDPA in
    the head-tail (load-balanced) order context_parallel shards them in."""
    import traceback

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer)
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    except Exception as exc:  # noqa: BLE001  (what happens is the claim)
        return {"raised": type(exc).__name__, "message": str(exc),
                "where": traceback.format_exc()}
    rows = _HeadTailLoadBalancer(16, world_size, "cpu")._generate_indices(restore=False)[0]
    mine = rows.view(world_size, -1)[rank]
    return {"raised": "", "type": type(out).__name__, "shape": tuple(out.shape),
            "err": float((out - want[:, :, mine]).abs().max())}


# ------------------------------------------------------------------ §9 context_parallel
def test_sdpa_on_cpu_runs_a_kernel_context_parallel_does_not_replace():
    """09 "PyTorch's own context_parallel": “On a CPU tensor,
    `F.scaled_dot_product_attention` runs the kernel
    `aten._scaled_dot_product_flash_attention_for_cpu`, and `context_parallel` replaces only
    CUDA's flash, memory-efficient and cuDNN kernels with its ring”."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 16, 8)
    with Ops():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert CPU_KERNEL in Ops.seen
    aten = torch.ops.aten
    assert {str(op) for op in custom_ops} == {str(op) for op in (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_cudnn_attention_backward.default)}
    assert CPU_KERNEL not in {str(op) for op in custom_ops}


def test_context_parallel_causal_on_cpu_raises():
    """09 "PyTorch's own context_parallel": “Causal, on 2 gloo ranks, the SDPA call inside
    `context_parallel` raises `NotImplementedError: Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered.`”"""
    got = lk.run(_cp_job, 2, args=(True,), backend="gloo", timeout=60, echo=False).values
    for r in got:
        assert r["raised"] == "NotImplementedError", r
        assert r["message"] == (f"Operator {CPU_KERNEL} does not have a sharding strategy "
                                f"registered.")


def test_the_cpu_kernel_has_a_decomposition_dtensor_can_trace():
    """09 "PyTorch's own context_parallel": “Not causal, DTensor instead derives a sharding by
    tracing the kernel's decomposition”."""
    from torch._decomp import decomposition_table
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op in decomposition_table and DecompShardingStrategy.has_decomp(op)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("LABKIT_SLOW_CLAIMS") != "1",
                    reason="about 70 s of CPU: set LABKIT_SLOW_CLAIMS=1 to run it")
def test_context_parallel_not_causal_on_cpu_returns_the_right_rows():
    """09 "PyTorch's own context_parallel": “checks that the rows come back right and in the
    load-balanced order”."""
    got = lk.run(_cp_job, 2, args=(False,), backend="gloo", timeout=500, deadline=560,
                 echo=False).values
    for r in got:
        assert r["raised"] == "" and r["type"] == "Tensor" and r["shape"] == (1, 2, 8, 8), r
        assert r["err"] < 1e-5, r


# ------------------------------------------------------------------ §8 bytes
def _framing_job(rank, world_size):
    import torch.distributed as dist

    from labkit.grading.watch import Watch
    w = Watch()
    x = torch.ones(world_size * 256)                   # 1 KiB to every peer
    out = torch.empty_like(x)
    w.start()
    dist.all_to_all_single(out, x)
    a2a = w.stop()["sent"]
    w.start()
    if rank == 0:
        dist.isend(torch.ones(256), 1).wait()
    elif rank == 1:
        dist.irecv(torch.empty(256), 0).wait()
    pair = w.stop()["sent"]
    dist.barrier()
    return a2a, pair


def test_gloo_frames_every_message_with_96_bytes_and_its_receiver_answers_with_48():
    """09 "Bytes per step": “gloo adds 96 bytes to every message it sends, and the receiving
    rank answers with 48: where every rank sends as many messages as it receives (a ring step,
    an all-to-all: one message to each of the N - 1 others), that is 144 bytes per message”."""
    got = lk.run(_framing_job, 3, backend="gloo", timeout=60, echo=False).values
    for rank, (a2a, pair) in enumerate(got):
        assert a2a == 2 * (1024 + 144), (rank, a2a)
        assert pair == {0: 1024 + 96, 1: 48, 2: 0}[rank], (rank, pair)


# ------------------------------------------------------------------ the quotes
def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
