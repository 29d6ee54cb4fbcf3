"""Claim tests: what torch's DistributedDataParallel does on torch 2.13.0 (gloo, real ranks).

Memory per parameter read from tensor storages, the bucket sizes DDP really all-reduces, what
``broadcast_buffers`` does to BatchNorm, and the DETAIL segfault (a bug of this version, tested
so that we notice when it is fixed). Each docstring quotes the sentence it backs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

import labkit as lk
from labkit import data_vs_model

import _claims

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

pytestmark = pytest.mark.timeout(180)


def _ddp_storage_bytes(rank, world_size, gradient_as_bucket_view):
    """Bytes per parameter held by one DDP rank: params + grads + DDP buckets + Adam state."""
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 4))
    ddp = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
    buckets = {}

    def remember(state, bucket):                # the flat tensor DDP all-reduces
        s = bucket.buffer().untyped_storage()
        buckets[bucket.index()] = (s.data_ptr(), s.nbytes())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, remember)
    opt = torch.optim.Adam(ddp.parameters())
    for _ in range(3):                          # buckets are rebuilt after the first iteration
        ddp(torch.randn(8, 256)).sum().backward()
        opt.step()

    def storages(tensors):
        return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}

    params = storages(model.parameters())
    grads = storages(p.grad for p in model.parameters())
    adam = storages(v for st in opt.state.values() for v in st.values() if v.dim() > 0)
    every = params | grads | set(buckets.values()) | adam
    n = sum(p.numel() for p in model.parameters())
    return {"total": sum(b for _, b in every) / n, "params": sum(b for _, b in params) / n,
            "grads": sum(b for _, b in grads) / n, "adam": sum(b for _, b in adam) / n,
            "grads_are_bucket_views": grads <= set(buckets.values())}


def test_torch_ddp_holds_a_bucket_copy_of_every_gradient():
    """01 "4 · Memory per rank": “keeps one more copy of the gradients, the flat buffers it
    all-reduces them in: 20 bytes per parameter with Adam in fp32”; "5 · Measure it": “makes the
    gradients views into the buckets and saves that copy: 16 bytes per parameter again”."""
    default, views = (lk.run(_ddp_storage_bytes, 2, args=(flag,), timeout=30, echo=False).values
                      for flag in (False, True))
    for rank in default:
        assert rank == {"total": 20.0, "params": 4.0, "grads": 4.0, "adam": 8.0,
                        "grads_are_bucket_views": False}
    for rank in views:                          # the gradients live inside the buckets
        assert rank["total"] == 16.0 and rank["grads_are_bucket_views"]
    gpt2 = data_vs_model.gpt_like()
    rows = {r["strategy"]: r for r in data_vs_model.memory_table(gpt2, 4)}
    n = sum(p.numel() for p in gpt2.parameters())
    assert rows["data parallel (DDP)"]["GB"] == pytest.approx(n * default[0]["total"] / 1e9)


def _bucket_sizes(rank, world_size, kwargs):
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(32)])  # 32 x 1 MiB of fp32
    ddp = DDP(model, **kwargs)
    sizes, it = {}, [0]

    def record(state, bucket):
        sizes.setdefault(it[0], []).append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, record)
    for it[0] in range(3):
        ddp(torch.randn(4, 512)).sum().backward()
    return sizes


def test_torch_ddp_buckets_one_bucket_first_then_a_small_first_bucket():
    """02 "Overlap and bucket size, measured": “torch DDP (2.13.0) puts all parameters in one
    bucket for the first iteration, then rebuilds its buckets in the order the gradients
    arrived; unless you pass `bucket_cap_mb`, the first bucket closes at 1 MiB and the others at
    25 MiB”."""
    import torch.distributed as dist

    layer = (512 * 512 + 512) * 4                       # one Linear's fp32 gradients
    default = lk.run(_bucket_sizes, 2, args=({},), timeout=30, echo=False).values[0]
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20 <= layer < 25 * 2**20 <= 25 * layer
    assert default[0] == [32 * layer]                   # iteration 0: everything in one bucket
    # rebuilt, last layers first: 1 MiB reached after one layer, 25 MiB after 25 more
    assert default[1] == default[2] == [layer, 25 * layer, 6 * layer]
    explicit = lk.run(_bucket_sizes, 2, args=({"bucket_cap_mb": 25},), timeout=30,
                      echo=False).values[0]
    assert explicit[2] == [25 * layer, 7 * layer]       # an explicit cap: no small first bucket


def _batchnorm_under_ddp(rank, world_size):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ddp = DDP(model)                                    # broadcast_buffers=True (the default)
    bn = model[1]
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(2):
        x = torch.randn(16, 3, generator=g) + 3 * rank  # each rank its own data
        h = model[0](x).detach()
        y = ddp(x)
        own = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + bn.eps)
        out.append({"own_batch_stats": torch.allclose(y.detach(), own * bn.weight + bn.bias,
                                                      atol=1e-5),
                    "batch_mean": h.mean(0), "running_mean": bn.running_mean.clone()})
        y.sum().backward()
    ddp.eval()
    with torch.no_grad():
        ddp(torch.randn(4, 3))
    return out, bn.running_mean.clone()


def test_ddp_broadcasts_rank0_batchnorm_buffers_at_every_forward():
    """02 "Common pitfalls": “DDP copies rank 0's buffers to every rank at the start of each
    forward (torch 2.13 skips the copy when the forward before it ran under `no_sync()` or
    `torch.no_grad()`): each rank normalises with its own batch's statistics, and the running
    statistics that survive are rank 0's, computed from rank 0's data alone”, “By default (in
    torch 2.13 `forward_sync_buffers`, which replaces the deprecated `broadcast_buffers`; both
    default to on)”. And 04 "BatchNorm statistics under DDP" says the same: “DDP copies rank 0's
    buffers to every rank at the start of each forward (torch 2.13 skips the copy when the
    forward before it ran under `no_sync()` or `torch.no_grad()`): each rank normalises with its
    own batch's statistics, and the running statistics that survive are rank 0's, computed from
    rank 0's data alone”."""
    import torch

    sys.path.insert(0, str(_claims.ROOT / "tests" / "ddp"))
    from test_torch_ddp_semantics import SYNCED, buffer_job, synced   # which forwards copy

    r0, r1 = lk.run(buffer_job, 2, timeout=30, echo=False).values     # train, no_sync, eval ...
    assert tuple(synced(r0, r1)) == SYNCED == (True, True, False, False, True)

    (steps0, end0), (steps1, end1) = lk.run(_batchnorm_under_ddp, 2, timeout=30, echo=False).values
    m = 0.1                                             # BatchNorm's default momentum
    for s in range(2):
        assert steps0[s]["own_batch_stats"] and steps1[s]["own_batch_stats"]
    # step 1 on rank 1 started from rank 0's running mean (broadcast), not from its own
    start = steps0[0]["running_mean"]
    torch.testing.assert_close(steps1[1]["running_mean"],
                               (1 - m) * start + m * steps1[1]["batch_mean"])
    assert not torch.allclose(steps1[1]["running_mean"], steps0[1]["running_mean"])
    torch.testing.assert_close(end1, end0)              # after a forward: rank 0's, everywhere
    assert torch.equal(end0, steps0[1]["running_mean"])


DETAIL_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    DDP(torch.nn.Linear(2, 2))
    print("constructed", flush=True)
    dist.destroy_process_group()
""")


def _torchrun(script, env, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "make_ddp.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(path)]
    return _claims.run_tree(cmd, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})


@pytest.mark.timeout(240)
def test_ddp_construction_segfaults_under_detail_on_torch_2_13(tmp_path):
    """04 "3 · Mismatched collectives": “on torch 2.13.0, constructing `DistributedDataParallel`
    on gloo with `TORCH_DISTRIBUTED_DEBUG=DETAIL` crashes the process with a segfault”. Plain
    torchrun, no labkit: the bug is torch's. When this test fails, the bug is fixed: change 04 §3
    and checklist item 5, and this test."""
    import torch

    detail = _torchrun(DETAIL_SCRIPT, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, tmp_path)
    info = _torchrun(DETAIL_SCRIPT, {"TORCH_DISTRIBUTED_DEBUG": "INFO"}, tmp_path)
    assert info.returncode == 0 and info.stdout.count("constructed") == 2, info.stderr[-2000:]
    assert torch.__version__.startswith("2.13.0")
    assert detail.returncode != 0 and "SIGSEGV" in detail.stderr, (
        f"DDP under DETAIL no longer segfaults on torch {torch.__version__}: update notebook 04 "
        f"§3, its checklist item 5 and quiz 04.detail.\n{detail.stderr[-2000:]}")


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
