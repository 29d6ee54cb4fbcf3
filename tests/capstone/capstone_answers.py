"""Answers to notebook 08's exercises for tests/capstone/test_capstone_check.py: the solution and the usual mistakes.

Each set is a dict of pieces by the names the script uses: ``{"all_reduce_sums": ...,
"save_checkpoint": ..., "load_checkpoint": ...}`` (the notebook's ``capstone_pieces()`` returns
the two checkpoint functions, :func:`checkpoint_pieces`; its ``all_reduce_sums`` is graded
alone). The wrong ones are mistakes a learner makes, and shortcuts of every class (state
hidden in memory, the project's own code doing the work, a side channel: the store or a file,
an evaluation not split over the ranks); the tests pin which rubric item each one fails and
with what message.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from labkit.capstone.evaluate import all_reduce_sums as project_all_reduce_sums


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------ the solution
def all_reduce_sums(window_losses, real, device):
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()]).to(device)
    if dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return both[0].item(), int(both[1].item())


def _rng(device):
    """This rank's generators: the CPU's and, on a GPU, the CUDA one's (dropout draws there)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def save_checkpoint(path, model, optimizer, device):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{_rank()}": _rng(device)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_checkpoint(path, model, optimizer, device, restore_rng=True):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    key = f"rank{_rank()}"
    if restore_rng:
        state["rng"] = {key: _rng(device)}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if restore_rng:
        torch.set_rng_state(state["rng"][key]["cpu"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"][key]["cuda"], device)


def solution():
    return {"all_reduce_sums": all_reduce_sums, "save_checkpoint": save_checkpoint,
            "load_checkpoint": load_checkpoint}


def capstone_pieces():
    """The notebook's capstone_pieces (§10): the two checkpoint functions."""
    return {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint}


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


def rank_0_times_world(window_losses, real, device):
    """Rank 0's own sums broadcast and scaled by the world size (10 windows by coincidence)."""
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()])
    dist.broadcast(both, src=0)
    both *= dist.get_world_size()
    return both[0].item(), int(both[1].item())


def divided_by_world(window_losses, real, device):
    """Sums added, then divided by the world size (what ReduceOp.AVG would do)."""
    both = torch.stack([window_losses[real].double().sum(), real.sum().double()])
    dist.all_reduce(both)
    both /= dist.get_world_size()
    return both[0].item(), int(both[1].item())


def float32_sum(window_losses, real, device):
    """Right, but added in float32: off in the last bits."""
    both = torch.stack([window_losses[real].float().sum(), real.sum().float()])
    dist.all_reduce(both)
    return both[0].item(), int(both[1].item())


def evaluated_again_everywhere(window_losses, real, device):
    """Not split: ignores its inputs, finds the model and the validation set in the caller's
    frames and evaluates every window itself on every rank (the right number, no all-reduce)."""
    frame = inspect.currentframe()
    while frame is not None and not {"model", "data", "batch_size"} <= set(frame.f_locals):
        frame = frame.f_back
    model, data, batch = (frame.f_locals[k] for k in ("model", "data", "batch_size"))
    total, n, training = 0.0, len(data), model.training
    model.eval()                                    # evaluate() restored training mode
    with torch.no_grad():
        for start in range(0, n, batch):
            idx = list(range(start, min(start + batch, n)))
            idx += idx[:1] * (batch - len(idx))          # same shape as the script's passes
            x = torch.stack([data[i][0] for i in idx]).to(device)
            y = torch.stack([data[i][1] for i in idx]).to(device)
            logits, _ = model(x)
            per = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none").mean(1)
            total += per[:min(batch, n - start)].double().sum().item()
    model.train(training)
    return total, n


def through_the_store(window_losses, real, device):
    """The right sums, passed through the process group's TCPStore: no collective (a side
    channel)."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    call = store.add(f"my-sums-calls-{rank}", 1)
    mine = (window_losses[real].double().sum().item(), int(real.sum().item()))
    store.set(f"my-sums-{call}-{rank}", repr(mine))
    keys = [f"my-sums-{call}-{r}" for r in range(world)]
    store.wait(keys)
    parts = [eval(store.get(k).decode()) for k in keys]      # noqa: S307 (our own repr)
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def the_projects_own(window_losses, real, device):
    """The project's own all_reduce_sums, found at run time (the checker's oracle)."""
    module = importlib.import_module("labkit.capstone." + "evaluate")
    return module.all_reduce_sums(window_losses, real, device)


def by_the_projects_name(window_losses, real, device):
    """The project's own all_reduce_sums under a name of this module (a by-reference global)."""
    return project_all_reduce_sums(window_losses, real, device)


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


_KEPT: dict = {}


def save_keeping_a_copy(path, model, optimizer, device):
    """A real DCP save, and a copy of the state kept in memory (hidden state)."""
    save_checkpoint(path, model, optimizer, device)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _KEPT[str(Path(path).name)] = ({k: v.detach().clone() for k, v in model_sd.items()}, optim_sd)


def load_from_memory(path, model, optimizer, device, restore_rng=True):
    """Restores the copy kept in memory; a new process has none, so it restores nothing."""
    kept = _KEPT.get(str(Path(path).name))
    if kept is not None:
        set_state_dict(model, optimizer, model_state_dict=kept[0], optim_state_dict=kept[1])


def _side_file(path, rank) -> Path:
    """A file of its own beside the run's folders: <grading>/two|one/run/checkpoints/step_N."""
    return Path(path).parents[3] / f"my-copy-{Path(path).name}-rank{rank}.pt"


def save_with_a_side_file(path, model, optimizer, device):
    """A real DCP save, and the whole state in a file of its own outside the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    save_checkpoint(path, model, optimizer, device)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)     # every rank
    torch.save({"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()},
               _side_file(path, _rank()))


def load_from_the_side_file(path, model, optimizer, device, restore_rng=True):
    """Restores from the file of its own (rank 0's state on any world size), not the folder."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    state = torch.load(_side_file(path, 0), weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    if restore_rng:
        torch.set_rng_state(torch.load(_side_file(path, _rank()), weights_only=False)["rng"])


def save_by_the_project(path, model, optimizer, device):
    """The project's own save, found at run time (the checker's oracle)."""
    module = importlib.import_module("labkit.capstone." + "sharded_checkpoint")
    module.save_checkpoint(path, model, optimizer, device)


def load_by_the_project(path, model, optimizer, device, restore_rng=True):
    module = importlib.import_module("labkit.capstone." + "sharded_checkpoint")
    module.load_checkpoint(path, model, optimizer, device, restore_rng=restore_rng)


def pieces(**replace):
    """The solution with some pieces replaced: ``pieces(all_reduce_sums=rank_local)`` (all
    three: the tests grade a reduction and a checkpoint code in one run)."""
    out = {**solution(), **replace}
    return lambda: out


def checkpoint_pieces(**replace):
    """What the notebook's ``capstone_pieces`` returns (§10: the two checkpoint functions),
    some replaced: ``checkpoint_pieces(save_checkpoint=save_rank_files)``."""
    out = {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint, **replace}
    return lambda: out
