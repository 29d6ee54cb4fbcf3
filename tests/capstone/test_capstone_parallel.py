"""Gradient accumulation really skips communication (DDP no_sync, FSDP2 set_requires_gradient_sync); bf16 runs.

Counted where the code under test cannot fake it: a DDP comm hook is called once
per gradient bucket that is all-reduced; CommDebugMode counts FSDP2's
reduce-scatters (FIELD_NOTES: it sees FSDP2's collectives on gloo in 2.13).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import labkit as lk
from capstone_common import TINY, losses, no_ranks_at_the_end, on_ranks
from labkit.capstone import train_gpt as G
from labkit.capstone.model import GPTConfig, make_gpt

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow,
              pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]

N_LAYER = 2


def _syncs(rank: int, world_size: int, parallel: str, micro: int, skip: bool) -> int:
    """Run one step of ``micro`` micro-batches; count gradient collectives."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as hooks
    from torch.distributed.tensor.debug import CommDebugMode

    model = make_gpt(GPTConfig(block_size=16, n_layer=N_LAYER, n_head=2, n_embd=32, dropout=0.0))
    model = G.wrap(model, parallel, world_size, torch.device("cpu"))
    calls = []
    if parallel == "ddp":
        def counting(state, bucket):
            calls.append(bucket.index())
            return hooks.allreduce_hook(state, bucket)
        model.register_comm_hook(None, counting)
    x = torch.randint(256, (micro, 2, 16), generator=torch.Generator().manual_seed(rank))
    for i in range(micro):
        # one CommDebugMode per micro-batch: across several forward/backward passes its
        # module tracker raises IndexError (torch 2.13), and inside DDP's forward at all
        comm = CommDebugMode() if parallel == "fsdp" else contextlib.nullcontext()
        with comm, G.grad_sync(model, sync=(i == micro - 1) or not skip):
            _, loss = model(x[i], x[i])
            loss.backward()
        if parallel == "fsdp":
            calls += [op for op, n in comm.get_comm_counts().items() for _ in range(n)
                      if "reduce_scatter" in str(op)]
    return len(calls)


@pytest.mark.parametrize("parallel, per_step", [("ddp", 1), ("fsdp", N_LAYER + 1)])
def test_accumulation_communicates_once_per_step(parallel, per_step):
    """1 bucket for DDP's small model; FSDP2: one reduce-scatter per block, one for the rest."""
    with_sync = lk.run(_syncs, 2, args=(parallel, 4, True), echo=False, timeout=60).values
    without = lk.run(_syncs, 2, args=(parallel, 4, False), echo=False, timeout=60).values
    assert with_sync == [per_step] * 2
    assert without == [4 * per_step] * 2          # negative control: every micro-batch syncs


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_bf16_autocast_trains_close_to_float32(parallel):
    argv = TINY + ["--out-dir", "", "--parallel", parallel, "--steps", "8", "--dropout", "0"]
    fp32 = losses(on_ranks(argv).stdout[0])
    bf16 = losses(on_ranks(argv + ["--bf16"]).stdout[0])
    assert fp32.keys() == bf16.keys() and fp32 != bf16
    assert all(abs(bf16[s] - fp32[s]) < 0.05 for s in fp32)
    assert bf16[8] < bf16[1]
