"""Which jobs need torch._dynamo (labkit/runtime/preload.py): the claim behind the list, the
reading of a job's code, and the launcher acting on it (ranks forked at once for a plain job, a
pool replaced for one that needs it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import labkit as lk
from labkit.runtime import procs
from labkit.runtime.preload import needs_dynamo

# The claim (torch 2.13, CPU, gloo): what imports torch._dynamo in a fresh process and what does
# not. One process imports torch; each case runs in a fork of it, with a group of its own.
_CLAIM = textwrap.dedent(r"""
    import os, sys, torch, torch.distributed as dist
    m = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def plain():
        t = torch.ones(3); dist.all_reduce(t); dist.broadcast(t, 0); dist.barrier()
        dist.all_gather([torch.empty(3)], t); dist.reduce_scatter_tensor(torch.empty(3), t)
        m(x).sum().backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a): return a * 2
            @staticmethod
            def backward(ctx, g): return g * 2
        F.apply(torch.randn(3, requires_grad=True)).sum().backward()
        __import__("torch.distributed.nn")

    def ddp():
        torch.nn.parallel.DistributedDataParallel(m)
    def sgd():
        o = torch.optim.SGD(m.parameters(), lr=0.1); m(x).sum().backward(); o.step()
    def fsdp():
        from torch.distributed.fsdp import fully_shard
        fully_shard(m)
    def dtensor():
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
        distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    def checkpoint():
        from torch.utils.checkpoint import checkpoint
        checkpoint(m, x.requires_grad_(), use_reentrant=False).sum().backward()

    for case in (plain, ddp, sgd, fsdp, dtensor, checkpoint):
        pid = os.fork()
        if pid == 0:
            try:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                case()
                print(case.__name__, "torch._dynamo" in sys.modules, flush=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
""")


def test_the_apis_on_the_list_import_dynamo_and_plain_work_does_not():
    code, out, err = procs.run("dynamo claim", [sys.executable, "-c", _CLAIM], 120,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = dict(line.split() for line in out.splitlines())
    assert got == {"plain": "False", "ddp": "True", "sgd": "True", "fsdp": "True",
                   "dtensor": "True", "checkpoint": "True"}, err[-3000:]


def _cell(source: str) -> dict:
    """Define functions as a notebook cell does (module ``__main__``: shipped by value)."""
    ns = {"__name__": "__main__", "torch": torch, "lk": lk}
    exec(textwrap.dedent(source), ns)
    return ns


_CELLS = _cell("""
    import math, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def helper(t):
        dist.all_reduce(t)
        return t

    def plain(rank, world_size, scale=2.0):
        t = torch.full((4,), float(rank)) * scale
        return helper(t).sum().item() + math.pi

    def ddp_global(rank, world_size):
        return DDP(torch.nn.Linear(2, 2))

    def sgd_attr(rank, world_size):
        return torch.optim.SGD

    def import_inside(rank, world_size):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor

    def compiled(rank, world_size):
        return torch.compile(torch.nn.Linear(2, 2))

    def nested(rank, world_size):
        def inner():
            import torch.distributed.fsdp
        return inner

    def lesson_helper(rank, world_size):
        return lk.ddp

    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.optim.Adam

    def make_closure():
        opt = torch.optim.SGD
        return lambda rank, world_size: opt
""")


@pytest.mark.parametrize("name", ["ddp_global", "sgd_attr", "import_inside", "compiled", "nested",
                                  "lesson_helper"])
def test_a_job_that_names_what_imports_dynamo_needs_it(name):
    assert needs_dynamo(_CELLS[name])


def test_a_plain_job_does_not_need_it_with_plain_arguments():
    assert not needs_dynamo(_CELLS["plain"])
    assert not needs_dynamo(_CELLS["plain"], (torch.ones(3), torch.nn.Linear(2, 2), [1, "a"]),
                            {"scale": 3.0})


def test_anything_it_cannot_read_is_assumed_to_need_it():
    assert needs_dynamo(_CELLS["make_closure"]())                  # a closure over torch.optim
    assert needs_dynamo(_CELLS["plain"], (_CELLS["Model"](),))     # a model class of the cell's
    assert needs_dynamo(_CELLS["plain"], (torch.nn.Sequential(_CELLS["Model"]()),))
    assert needs_dynamo(_CELLS["plain"], (object(),))
    assert needs_dynamo(test_a_plain_job_does_not_need_it_with_plain_arguments)  # another module


def test_a_plain_first_job_gets_ranks_at_once_and_a_later_one_that_needs_dynamo_a_new_pool():
    """The zygote waits 60 s idle before its own preload here, so what the ranks hold comes
    from the job's reading alone."""
    jobs = _cell("""
        import sys

        def has_dynamo(rank, world_size):
            return "torch._dynamo" in sys.modules

        def needs(rank, world_size):
            if world_size < 0:
                torch.optim.SGD          # named, never run
            return "torch._dynamo" in sys.modules
    """)
    env = {"LABKIT_PRELOAD_IDLE_S": "60"}
    try:
        first = lk.run(jobs["has_dynamo"], world_size=2, env=env, echo=False)
        assert first.cold and first.values == [False, False]
        second = lk.run(jobs["needs"], world_size=2, env=env, echo=False)
        assert second.cold and second.values == [True, True]       # a new pool, preloaded
        third = lk.run(jobs["has_dynamo"], world_size=2, env=env, echo=False)
        assert not third.cold and third.values == [True, True]     # that pool serves it too
    finally:
        lk.shutdown()
