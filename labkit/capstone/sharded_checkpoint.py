"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save and load (notebook 08, "Checkpoints").

:func:`save_checkpoint` and :func:`load_checkpoint` are the two pieces the
notebook's exercise asks for. Every rank calls them together (they are
collectives):

* ``get_state_dict(model, optimizer)`` returns the model's and the
  optimizer's state with plain parameter names (no ``module.`` prefix of
  DDP, no FSDP wrapper names). Under FSDP2 the values are DTensors: each rank
  holds only its shard, and knows where it sits in the whole tensor.
* ``dcp.save`` has each rank write the pieces it holds (``__<rank>_0.distcp``;
  a tensor every rank holds alike, as under DDP, is written once) and rank 0
  write ``.metadata``: for every tensor its global shape and which byte range
  of which file holds which chunk.
* ``dcp.load`` fills a state dict *in place*: each rank asks for the chunks
  its own tensors cover, in the layout it has NOW, and reads them from
  whichever files hold them. That is resharding: saved by 2 FSDP ranks,
  loaded by 1 plain process or by 4 FSDP ranks, or by DDP, with the same
  values bit for bit.

What does not reshard: each rank's RNG state (one stream per rank, so there
is nothing to give a 3rd and 4th rank) is saved under ``rng/rank<r>`` and
restored only when the world size is unchanged. Step, data position and
config travel in the checkpoint's manifest (:mod:`labkit.portable.checkpoints`).

Resumed on the SAME number of ranks, a run is bit-identical to one that never
stopped: same values, same RNG streams, same data (the data position is the
step), same kernels and summation order. Resumed on ANOTHER number of ranks,
the state is still loaded exactly and the data is the same (each step's
global batch is the same set of windows on any world size), but the run
cannot stay bit-identical, for two reasons:

1. the gradient is the same sum in another order: each rank averages its own
   micro-batch first, then the all-reduce adds the ranks' results (gloo sums
   in its own order), and float addition is not associative; the last-bit
   differences grow step by step (Adam divides by small second moments);
2. dropout draws from per-rank RNG streams: N ranks draw N streams of masks
   for N slices of the batch, so other ranks means other masks.

``tests/capstone/test_capstone_reshard.py`` asserts what can be asserted: the loaded
parameters and optimizer state equal the saved ones bit for bit (1, 2, 4
ranks; FSDP2, DDP, one process), and training goes on with a loss close to the
2-rank run's.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

__all__ = ["save_checkpoint", "load_checkpoint", "full_model_state", "rng_state",
           "set_rng_state"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextmanager
def _one_process_quietly():
    """DCP warns that it "assumes" one process whenever there is no process group: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random-number generator states as tensors (CPU, and CUDA when used)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> None:
    """Every rank: write model + optimizer (each rank its shard) + its RNG state to ``path``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{_rank()}": rng_state(device)}}
    with _one_process_quietly():
        dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device, restore_rng: bool = True) -> None:
    """Every rank: load ``path`` into ``model`` and ``optimizer`` in their current sharding.

    ``restore_rng`` restores this rank's RNG state: only possible (and only
    asked for) when the checkpoint was written by the same number of ranks.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    rng_key = f"rank{_rank()}"
    if restore_rng:
        state["rng"] = {rng_key: rng_state(device)}       # the shapes DCP reads into
    with _one_process_quietly():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if restore_rng:
        set_rng_state(state["rng"][rng_key], device)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the whole model's parameters, gathered on CPU (rank 0 gets them; others: {})."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}
