"""Claim tests for notebook 08: each reproduces, on the pinned torch 2.13.0 and gloo, a sentence
the notebook says about torch. The docstring names the section and quotes the sentence
(``08 "§N": “...”``); the last test checks that every quoted sentence is still in
solutions/08_capstone.ipynb. What the capstone itself guarantees (bit-identical resume,
resharding, exact evaluation) is asserted in tests/capstone/, which the notebook cites.
"""
from __future__ import annotations

import sys
from collections import defaultdict

import cloudpickle
import pytest
import torch

import _claims
import labkit as lk

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)


def _save_one_step(rank: int, world_size: int, folder: str, parallel: str) -> dict:
    """One training step of a tiny capstone GPT, then dcp.save of get_state_dict (what the
    project's save_checkpoint writes, without the RNG): what kinds of values, which names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from labkit.capstone import train_gpt as G
    from labkit.capstone.model import GPTConfig, make_gpt

    cfg = G.parse_args(["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32"])
    model = G.wrap(make_gpt(GPTConfig(32, 256, 2, 2, 32, 0.0)), parallel, world_size,
                   torch.device("cpu"))
    opt = G._optimizer(model, cfg)
    x = torch.zeros(2, 32, dtype=torch.long)
    model(x, x)[1].backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    wte = model_sd["wte.weight"]
    return {"names": sorted(model_sd), "optim_names": sorted(optim_sd["state"]),
            "kind": type(wte).__name__,
            "local_rows": (wte.to_local() if hasattr(wte, "to_local") else wte).shape[0]}


def _where(folder) -> dict[str, list[tuple[str, tuple]]]:
    """For every tensor in a DCP checkpoint: (file, chunk offset) of each of its chunks."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    out = defaultdict(list)
    for index, info in meta.storage_data.items():
        out[index.fqn].append((info.relative_path, tuple(index.offset or ())))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for parallel in ("ddp", "fsdp"):
        folder = tmp_path_factory.mktemp(parallel)
        values = lk.run(_save_one_step, 2, args=(str(folder), parallel), echo=False,
                        timeout=60).values
        out[parallel] = (folder, values)
    return out


def test_fsdp2_files_hold_one_half_of_every_tensor_ddp_writes_each_tensor_once(saved):
    """08 "§3": “Under FSDP2 every rank holds only its shard of every parameter and of Adam's two
    moments, so each file holds one half of every sharded tensor and neither is a whole model.”
    “Under DDP every rank holds the same tensors, and DCP writes each of them once, into one of
    the files, spread over the ranks”."""
    folder, values = saved["fsdp"]
    where = _where(folder)
    tensors = [k for k in where if k.startswith("model.") or k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(tensors) == 3 * len(values[0]["names"])        # parameters + 2 Adam moments
    for key in tensors:
        assert sorted(f for f, _ in where[key]) == ["__0_0.distcp", "__1_0.distcp"], key
    assert values[0]["local_rows"] == values[1]["local_rows"] == 128      # wte: 256 rows, halved
    folder, _ = saved["ddp"]
    where = _where(folder)
    assert all(len(chunks) == 1 for chunks in where.values())            # each written once
    files = {chunks[0][0] for key, chunks in where.items() if key.startswith("model.")}
    assert files == {"__0_0.distcp", "__1_0.distcp"}                      # spread over the ranks


def test_get_state_dict_names_are_plain_and_fsdp2_values_are_dtensors(saved):
    """08 "§3": “`get_state_dict(model, optimizer)` returns the model's and the optimizer's state
    under plain parameter names (no `module.` prefix of DDP, no FSDP wrapper names), as DTensors
    under FSDP2”."""
    from labkit.capstone.model import GPTConfig, make_gpt

    plain = sorted(name for name, _ in make_gpt(GPTConfig(32, 256, 2, 2, 32, 0.0))
                   .named_parameters())
    for parallel, kind in (("ddp", "Tensor"), ("fsdp", "DTensor")):
        for rank_values in saved[parallel][1]:
            assert rank_values["names"] == plain and rank_values["optim_names"] == plain
            assert rank_values["kind"] == kind, parallel


def test_distributed_sampler_pads_with_the_first_windows():
    """08 "§5": “When N does not divide the number of windows, the sampler adds padding: it
    repeats the first windows so that every rank gets as many”."""
    from torch.utils.data import DistributedSampler

    shares = [list(DistributedSampler(range(9), num_replicas=4, rank=r, shuffle=False))
              for r in range(4)]
    assert shares == [[0, 4, 8], [1, 5, 0], [2, 6, 1], [3, 7, 2]]     # 0, 1, 2 again
    assert sorted(i for s in shares for i in s) == sorted(list(range(9)) + [0, 1, 2])


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
