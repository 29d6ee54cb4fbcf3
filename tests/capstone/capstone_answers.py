"""Answers to notebook 08's exercise for tests/capstone/test_capstone_check.py: the solution and the usual mistakes.

Each set is what ``capstone_pieces()`` returns in the notebook: ``{"all_reduce_sums": ...,
"save_checkpoint": ..., "load_checkpoint": ...}``. The wrong ones are mistakes a learner makes;
the tests pin which rubric item each one fails.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_state_dict, set_model_state_dict,
                                                     set_state_dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------ the solution
def all_reduce_sums(window_losses, real, device):
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()]).to(device)
    if dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return both[0].item(), int(both[1].item())


def save_checkpoint(path, model, optimizer, device):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{_rank()}": torch.get_rng_state()}}
    dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_checkpoint(path, model, optimizer, device, restore_rng=True):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    key = f"rank{_rank()}"
    if restore_rng:
        state["rng"] = {key: torch.get_rng_state()}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if restore_rng:
        torch.set_rng_state(state["rng"][key])


def solution():
    return {"all_reduce_sums": all_reduce_sums, "save_checkpoint": save_checkpoint,
            "load_checkpoint": load_checkpoint}


# ------------------------------------------------------------------ wrong evaluations
def mean_of_rank_means(window_losses, real, device):
    """Each rank's mean, averaged over the ranks (ranks with fewer windows weigh too much)."""
    mine = window_losses[real].double()
    both = torch.stack([mine.mean(), real.sum().double()])
    dist.all_reduce(both)
    mean = both[0].item() / dist.get_world_size()
    return mean * both[1].item(), int(both[1].item())


def padding_counted(window_losses, real, device):
    """Sums all-reduced, but DistributedSampler's duplicates counted."""
    both = torch.stack([window_losses.double().sum(), torch.tensor(len(window_losses)).double()])
    dist.all_reduce(both)
    return both[0].item(), int(both[1].item())


def rank_local(window_losses, real, device):
    """No all-reduce: each rank's own windows only."""
    return window_losses[real].double().sum().item(), int(real.sum().item())


def all_reduce_on_rank_0(window_losses, real, device):
    """A collective only one rank calls: rank 0 waits for rank 1 forever (a deadlock)."""
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()])
    if dist.get_rank() == 0:
        dist.all_reduce(both)
    return both[0].item(), int(both[1].item())


# ------------------------------------------------------------------ wrong checkpoints
def save_without_optimizer(path, model, optimizer, device):
    model_sd, _ = get_state_dict(model, optimizer)
    state = {"model": model_sd, "rng": {f"rank{_rank()}": torch.get_rng_state()}}
    dcp.save(state, checkpoint_id=str(path))


def load_without_optimizer(path, model, optimizer, device, restore_rng=True):
    model_sd, _ = get_state_dict(model, optimizer)
    state = {"model": model_sd}
    key = f"rank{_rank()}"
    if restore_rng:
        state["rng"] = {key: torch.get_rng_state()}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if restore_rng:
        torch.set_rng_state(state["rng"][key])


def save_without_rng(path, model, optimizer, device):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_without_rng(path, model, optimizer, device, restore_rng=True):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load_ignoring_the_checkpoint(path, model, optimizer, device, restore_rng=True):
    """Returns at once: the model keeps its fresh initial weights."""


def save_rank_files(path, model, optimizer, device):
    """Each rank torch.saves what it holds: fine on the same world size, not a reshardable checkpoint."""
    state = {"model": {k: v.to_local() if hasattr(v, "to_local") else v
                       for k, v in model.state_dict().items()},
             "optim": optimizer.state_dict(), "rng": torch.get_rng_state()}
    torch.save(state, f"{path}/rank{_rank()}.pt")
    dist.barrier()             # every file on disk before the script commits the checkpoint


def load_rank_files(path, model, optimizer, device, restore_rng=True):
    state = torch.load(f"{path}/rank{_rank()}.pt", weights_only=False)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            (v.to_local() if hasattr(v, "to_local") else v).copy_(state["model"][k])
    optimizer.load_state_dict(state["optim"])
    if restore_rng:
        torch.set_rng_state(state["rng"])


def pieces(**replace):
    """The solution with some pieces replaced: ``pieces(all_reduce_sums=rank_local)``."""
    out = {**solution(), **replace}
    return lambda: out
