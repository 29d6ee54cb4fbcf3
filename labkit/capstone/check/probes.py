"""What the capstone grader writes down inside a learner's run (notebook 08, "Exercise").

:mod:`labkit.capstone.check` ships the learner's ``all_reduce_sums`` and
``load_checkpoint`` into ``train_gpt.py --pieces`` wrapped by these two
functions (``functools.partial(reduce_probe, guard, learner_fn, folder, secret)``,
``functools.partial(load_probe, guard, learner_fn, folder)``). Each one calls the
learner's function and then records, in a folder the checker chose, what a
grader needs to judge it without trusting the learner's code:

* :func:`reduce_probe`: on every rank, at every evaluation, the inputs the
  script computed (each window's loss, which windows are real), the inputs the
  learner's function was given instead (each loss plus a number drawn from a
  per-grading secret, so that only adding what each rank was given gives the
  right sum: evaluating every window again on every rank does not), what came
  back, and how many collectives ran meanwhile on any process group (the
  backend's own sequence numbers: every thread, the backend object too; a
  store, a file or a socket runs none);
* :func:`load_probe`: right after each load, the whole model and optimizer
  state (gathered on rank 0), every rank's RNG state, and whether the load left
  the rank's part of the model exactly as it was;
* :class:`Guard`: unpickled before the learner's functions, it swaps the
  project's own capstone functions (:data:`GUARDED`) for recorders, so a
  piece that calls them (however it found them) is named.

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

__all__ = ["reduce_probe", "load_probe", "read_evals", "read_loads", "Guard", "GUARDED",
           "read_guarded"]

# the project's own implementations of the exercise's pieces (the checker's oracle)
GUARDED = {"labkit.capstone.evaluate": ("all_reduce_sums", "evaluate"),
           "labkit.capstone.sharded_checkpoint": ("save_checkpoint", "load_checkpoint")}


class Guard:
    """Unpickled in the learner's worker, before its pieces: see :func:`_install_guard`."""

    def __init__(self, folder: str):
        self.folder = folder

    def __reduce__(self):
        return _install_guard, (self.folder,)


def _install_guard(folder: str) -> "Guard":
    """Swap each :data:`GUARDED` function for one that records its use in ``folder``, then
    does the work (the run goes on; the checker fails the item that used it)."""
    import functools
    import importlib

    for name, attrs in GUARDED.items():
        module = importlib.import_module(name)
        for attr in attrs:
            real = getattr(module, attr)
            if getattr(real, "_labkit_guarded", False):
                continue

            @functools.wraps(real)
            def recorder(*args, _real=real, _name=f"{name}.{attr}", **kwargs):
                rank, _ = _rank_world()
                with open(Path(folder) / f"guarded-rank{rank}.txt", "a") as f:
                    f.write(_name + "\n")
                return _real(*args, **kwargs)
            recorder._labkit_guarded = True
            setattr(module, attr, recorder)
    return Guard(folder)


def read_guarded(folder: str | Path) -> set[str]:
    """The project's own functions the learner's pieces called, on any rank."""
    return {ln for p in Path(folder).glob("guarded-rank*.txt") for ln in p.read_text().split()}


def _collectives() -> int | None:
    """Collectives issued so far on every process group of this process (any thread; None:
    this torch or backend does not number them)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return sum(pg._get_sequence_number_for_group() for pg in list(_world.pg_map))
    except Exception:  # noqa: BLE001  (private API: the checker says it could not verify)
        return None


def _disguised(window_losses: torch.Tensor, secret: int, rank: int) -> torch.Tensor:
    """Each loss plus a number in [0.5, 1.5) drawn from the secret: float32, like the input
    (a float64 sum of a few thousand of them is still exact)."""
    gen = torch.Generator().manual_seed(secret + rank)
    noise = 0.5 + torch.rand(window_losses.shape, generator=gen)
    return (window_losses.float() + noise).float()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def reduce_probe(guard: Guard, fn: Callable, folder: str, secret: int,
                 window_losses: torch.Tensor, real: torch.Tensor, device: torch.device):
    """Call the learner's ``all_reduce_sums`` on disguised losses (:func:`_disguised`); append
    the script's and the given inputs, the result and the collectives run to a per-rank file.

    The script gets the learner's result back: its logged val loss is off by the disguise's
    mean (the grader's run is not shown; the checker judges the recorded numbers).
    """
    rank, world = _rank_world()
    disguised = _disguised(window_losses, secret, rank)
    given = {"losses": window_losses.tolist(), "given": disguised.tolist(),
             "real": real.tolist()}                               # before fn can touch them
    before = _collectives() if world > 1 else 0
    out = fn(disguised, real.clone(), device)
    after = _collectives() if world > 1 else 0
    ran = None if before is None or after is None else after - before
    try:
        result = [float(out[0]), int(out[1])]
    except (TypeError, ValueError, IndexError):
        result = repr(out)[:200]
    record = {"rank": rank, "world": world, "attempt": _attempt(), **given, "out": result,
              "collectives": ran}
    with open(Path(folder) / f"eval-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return out


def load_probe(guard: Guard, fn: Callable, folder: str, path, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, device: torch.device,
               restore_rng: bool = True) -> None:
    """Call the learner's ``load_checkpoint``; then save what the model and optimizer hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    before = _local_state(model)
    fn(path, model, optimizer, device, restore_rng=restore_rng)
    after = _local_state(model)
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                      for k in before)
    rank, world = _rank_world()
    rng = torch.get_rng_state()                       # before anything below could draw
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)  # every rank: a collective
    record = {"rank": rank, "world": world, "attempt": _attempt(), "restore_rng": restore_rng,
              "rng": rng, "unchanged": unchanged, "model": model_sd if rank == 0 else None,
              "optim": optim_sd if rank == 0 else None}
    name = Path(folder) / f"load-attempt{_attempt()}-rank{rank}.pt"
    torch.save(record, str(name) + ".tmp")
    os.replace(str(name) + ".tmp", name)


def _local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every entry of the model's state dict, copied (no collective)."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


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
