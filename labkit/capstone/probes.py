"""What the capstone grader writes down inside a learner's run (notebook 08, "Exercise").

:mod:`labkit.capstone.check` ships the learner's ``all_reduce_sums`` and
``load_checkpoint`` into ``train_gpt.py --pieces`` wrapped by these two
functions (``functools.partial(reduce_probe, learner_fn, folder)``). Each one
calls the learner's function unchanged and then records, in a folder the
checker chose, what a grader needs to judge it without trusting the
learner's code:

* :func:`reduce_probe`: on every rank, at every evaluation, the inputs the
  script gave (each window's loss, which windows are real) and what came back;
* :func:`load_probe`: right after each load, the whole model and optimizer
  state (gathered on rank 0) and every rank's RNG state.

The checker compares those with its own runs of the project's own code. Only
torch here: this runs in the learner's torchrun workers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["reduce_probe", "load_probe", "read_evals", "read_loads"]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def reduce_probe(fn: Callable, folder: str, window_losses: torch.Tensor, real: torch.Tensor,
                 device: torch.device):
    """Call the learner's ``all_reduce_sums``; append its inputs and result to a per-rank file."""
    given = {"losses": window_losses.tolist(), "real": real.tolist()}   # before fn can touch them
    out = fn(window_losses, real, device)
    rank, world = _rank_world()
    try:
        result = [float(out[0]), int(out[1])]
    except (TypeError, ValueError, IndexError):
        result = repr(out)[:200]
    record = {"rank": rank, "world": world, "attempt": _attempt(), **given, "out": result}
    with open(Path(folder) / f"eval-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return out


def load_probe(fn: Callable, folder: str, path, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, device: torch.device,
               restore_rng: bool = True) -> None:
    """Call the learner's ``load_checkpoint``; then save what the model and optimizer hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    fn(path, model, optimizer, device, restore_rng=restore_rng)
    rank, world = _rank_world()
    rng = torch.get_rng_state()                       # before anything below could draw
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)  # every rank: a collective
    record = {"rank": rank, "world": world, "attempt": _attempt(), "restore_rng": restore_rng,
              "rng": rng, "model": model_sd if rank == 0 else None,
              "optim": optim_sd if rank == 0 else None}
    name = Path(folder) / f"load-attempt{_attempt()}-rank{rank}.pt"
    torch.save(record, str(name) + ".tmp")
    os.replace(str(name) + ".tmp", name)


def read_evals(folder: str | Path) -> list[dict]:
    """Every recorded evaluation, every rank; ``index``: its number within the rank's attempt."""
    out = []
    for path in sorted(Path(folder).glob("eval-rank*.jsonl")):
        seen: dict[int, int] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                rec["index"] = seen.get(rec["attempt"], 0)
                seen[rec["attempt"]] = rec["index"] + 1
                out.append(rec)
    return out


def read_loads(folder: str | Path) -> list[dict]:
    """Every recorded load (one per rank per attempt that loaded a checkpoint)."""
    return [torch.load(p, weights_only=False) for p in sorted(Path(folder).glob("load-*.pt"))]
