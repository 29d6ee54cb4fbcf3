"""Claim tests: tensor parallelism on torch 2.13.0 (DTensor on gloo, 2 real ranks).

``CommDebugMode`` counts the collectives torch really issues, so the count does not trust the
code under test. Each docstring quotes the sentence it backs.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import labkit as lk

import _claims

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

pytestmark = pytest.mark.timeout(120)


def _tensor_parallel_forward(rank, world_size, blocks):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
                            for _ in range(blocks)])
    plan = {}
    for i in range(blocks):                         # Megatron's MLP split: columns, then rows
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, mesh, plan)
    x = torch.randn(4, 8)
    with CommDebugMode() as comm:
        model(x)
    shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return {str(k): v for k, v in comm.get_comm_counts().items()}, shards


def test_tensor_parallel_ranks_work_on_every_layer_and_all_reduce_inside_it():
    """01 "2 · The concept": “its ranks work on every layer, each on its slice of every matrix,
    and all-reduce the activations inside every layer”."""
    for counts, shards in lk.run(_tensor_parallel_forward, 2, args=(3,), timeout=30,
                                    echo=False).values:
        assert {k.split(".")[-1]: v for k, v in counts.items()} == {"all_reduce": 3}
        for i in range(3):                          # every rank holds half of every matrix
            assert shards[f"{i}.0.weight"] == (16, 8) and shards[f"{i}.2.weight"] == (8, 16)


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
