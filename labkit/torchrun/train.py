"""The lab's training script: one file, one process or DDP under torchrun, survives a crash.

Notebook 05 (torchrun and fault tolerance) ships this file. Like nanoGPT's
``train.py`` it runs unchanged as a single process or as DDP, and the DDP
difference is small: every line that exists only for DDP ends in ``# [dist]``
(``grep -n "\\[dist\\]" labkit/torchrun/train.py`` lists them). It trains a small MLP on
a synthetic 3-class spiral data set generated deterministically (no download),
shards it with ``DistributedSampler`` + ``set_epoch``, and logs on rank 0 only.

Runbook (from the repository root)::

    # one process
    python -m labkit.torchrun.train --snapshot-dir /tmp/run1
    # DDP, 2 ranks on this machine; a crashed worker restarts the group (up to 2 times)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 \\
      python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=2 \\
      -m labkit.torchrun.train --snapshot-dir /tmp/run2 --crash-rank 1 --crash-at-step 20
    # two nodes (run on each; HOST = node 0's address, shared --snapshot-dir)
    python -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --max-restarts=3 \\
      --rdzv-id=job42 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
      -m labkit.torchrun.train --snapshot-dir /shared/run3

Fault tolerance: every ``--snapshot-every`` steps rank 0 writes a snapshot
(model, optimizer, every rank's RNG states, epoch, step and the sampler
position) into its own folder ``step_NNNNNNNN/``, then a manifest of the file's
size and SHA-256, written last and atomically (:mod:`labkit.portable.checkpoints`).
The newest ``--keep`` snapshots stay (default 2). A (re)started run resumes from
the newest snapshot that matches its manifest: a truncated, zero-filled,
overwritten or deleted one is skipped with a log line naming the file and the
cause, and the run falls back to the one before; when none is whole the run
stops with an error naming every file. So a group restarted by torchrun ends
with the same parameters, bit for bit, as a run that never failed. ``--crash-rank R --crash-at-step S`` makes
rank R raise at step S on the first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0). On gloo set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's
environment: with torch 2.13's shared rendezvous store, restarted gloo groups
often fail to connect (``Gloo connectFullMesh failed``).

In Python: ``train(parse_args([...]))`` trains inside an already initialised
process group; the lesson's ``lk.torchrun.reference([...], world_size=2)`` does that on
warm lab ranks and returns the final parameters. This file imports only torch,
:mod:`labkit.portable.checkpoints`, :mod:`labkit.portable.elastic` (torch's ``@record`` with its
error file written whole) and :mod:`labkit.portable.ending` (a rank's end without a gloo abort),
plain Python all three: it is the leaf a learner copies into their own project, with them.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist  # [dist]
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # [dist]
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..portable.checkpoints import Checkpoints, NoValidCheckpoint
from ..portable.elastic import record   # torch's @record; its error file written whole
from ..portable.ending import run_then_exit  # [dist]

__all__ = ["make_dataset", "make_model", "parse_args", "train", "main",
           "ResumableSampler", "InjectedFault", "save_snapshot", "load_snapshot", "load_final",
           "snapshots", "NoValidCheckpoint",
           "parse_log", "SNAPSHOT", "FINAL"]

SNAPSHOT, FINAL = "snapshot.pt", "final.pt"
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


class InjectedFault(RuntimeError):
    """The crash asked for with ``--crash-rank/--crash-at-step`` (first attempt only)."""


def make_dataset(samples: int = 1024, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Points on ``classes`` interleaved noisy spirals (x: [samples, 2], y: class index).

    The same arguments give the same tensors on every machine and rank.

    >>> len(make_dataset(30)), make_dataset(30)[0][0].shape
    (30, torch.Size([2]))
    """
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(samples) % classes
    r = torch.rand(samples, generator=g)
    angle = y * (2 * math.pi / classes) + 4.0 * r + 0.25 * torch.randn(samples, generator=g)
    x = torch.stack([r * torch.sin(angle), r * torch.cos(angle)], dim=1)
    return TensorDataset(x.float(), y)


def make_model(hidden: int = 64, dropout: float = 0.1, classes: int = 3, seed: int = 0) -> nn.Module:
    """A small MLP with the same initial weights for the same ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Dropout(dropout),
                             nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start mid-epoch: it skips ``start`` of this rank's indices.

    The order of an epoch depends only on ``seed + epoch`` (``set_epoch``), so a
    resumed run sees exactly the samples the interrupted one had not seen yet.
    """

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options (``python -m labkit.torchrun.train --help``)."""
    p = argparse.ArgumentParser(prog="python -m labkit.torchrun.train", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-dir", default="snapshots", help="'' to write nothing")
    p.add_argument("--snapshot-every", type=int, default=8, help="steps between snapshots")
    p.add_argument("--keep", type=int, default=2, help="snapshots kept (the newest K, >= 1)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (seconds)")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--show-env", action="store_true", help="every rank prints torchrun's env")
    return p.parse_args(argv)


def save_snapshot(path: str | Path, state: dict) -> None:
    """Write ``state`` so that ``path`` always holds a whole file: temp file, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a crash mid-write leaves no half file under this name


def snapshots(snapshot_dir: str | Path, keep: int = 2, log=print) -> Checkpoints:
    """The run's snapshot folders: rotation (the newest ``keep``) and verification."""
    return Checkpoints(snapshot_dir, keep, log)


def load_snapshot(snapshot_dir: str | Path, log=print) -> dict | None:
    """The newest snapshot in ``snapshot_dir`` that matches its manifest (older ones are tried
    when it is damaged, each skip logged), or None when there is none; raises
    :class:`~labkit.portable.checkpoints.NoValidCheckpoint` naming every file when none is whole.
    """
    found = snapshots(snapshot_dir, log=log).latest()
    if found is None:
        return None
    return torch.load(found.path / SNAPSHOT, map_location="cpu", weights_only=True)


def load_final(snapshot_dir: str | Path) -> dict[str, torch.Tensor]:
    """The final parameters a finished run wrote (``final.pt``)."""
    path = Path(snapshot_dir) / FINAL
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: the run did not finish (look at its log "
                                f"for the failure), or it wrote to another --snapshot-dir.")
    return torch.load(path, map_location="cpu", weights_only=True)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _check_sizes(cfg, world_size: int) -> None:
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} is the global batch and must split evenly "
                         f"over {world_size} ranks: use a multiple of {world_size}.")
    if cfg.samples % cfg.batch_size:
        raise ValueError(f"--samples {cfg.samples} must be a multiple of --batch-size "
                         f"{cfg.batch_size}, so every step sees a whole batch on every rank.")


_SAME = ("samples", "batch_size", "seed", "hidden")   # options a resumed run must keep


def _check_resumable(snap: dict, cfg, where: Path) -> None:
    for key in _SAME:
        was, now = snap["config"].get(key), getattr(cfg, key)
        if was != now:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"the snapshot in {where} was made with {flag} {was}, this run has "
                             f"{flag} {now}: resuming would mix two different runs. Use the same "
                             f"options, or another --snapshot-dir to start fresh.")


def _restore(snap: dict, model, opt, rank: int, world_size: int, device) -> tuple[int, int, int]:
    """Load a snapshot into model/optimizer/RNG; return (step, epoch, samples done in epoch)."""
    model.load_state_dict(snap["model"])
    opt.load_state_dict(snap["optimizer"])
    if snap["world_size"] == world_size:
        _set_rng_state(snap["rng"][rank], device)
    elif rank == 0:  # elastic: same data order, but dropout streams cannot be carried over
        print(f"note: snapshot from {snap['world_size']} ranks, now {world_size}: same data "
              f"order, new dropout RNG streams (not bit-identical to an uninterrupted run)")
    return snap["step"], snap["epoch"], snap["samples_in_epoch"]


def train(cfg: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Train with ``cfg`` (see :func:`parse_args`); return the final parameters (on CPU).

    Runs DDP when a process group is initialised (torchrun via :func:`main`, or
    ``lk.run``), else as one process. Resumes from ``cfg.snapshot_dir`` if it
    holds a snapshot.
    """
    ddp = dist.is_available() and dist.is_initialized()                        # [dist]
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)  # [dist]
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = dist.get_backend() == "nccl" if ddp else torch.cuda.is_available()  # [dist]
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    master = rank == 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _check_sizes(cfg, world_size)
    if cfg.show_env:
        print("env", " ".join(f"{k}={os.environ[k]}" for k in TORCHRUN_ENV if k in os.environ),
              flush=True)

    data = make_dataset(cfg.samples, seed=cfg.seed)
    model = make_model(cfg.hidden, cfg.dropout, seed=cfg.seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    torch.manual_seed(cfg.seed + 1000 + rank)              # each rank its own dropout masks
    sampler = ResumableSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(data, batch_size=cfg.batch_size // world_size, sampler=sampler,
                        generator=torch.Generator())       # keeps the global RNG out of the loader
    step, epoch, done = 0, 0, 0
    snap_dir = Path(cfg.snapshot_dir) if cfg.snapshot_dir else None
    say = (lambda msg: print(msg, flush=True)) if master else (lambda msg: None)
    snaps = snapshots(snap_dir, cfg.keep, say) if snap_dir else None
    found = snaps.latest() if snaps else None          # every rank checks the same files
    if found is not None:
        snap = torch.load(found.path / SNAPSHOT, map_location="cpu", weights_only=True)
        _check_resumable(snap, cfg, snap_dir)
        step, epoch, done = _restore(snap, model, opt, rank, world_size, device)
        say(f"resumed from {found.path}: step {step}, epoch {epoch}, sample {done} "
            f"of {cfg.samples} (attempt {attempt})")
    elif snap_dir and master:
        snap_dir.mkdir(parents=True, exist_ok=True)
    say(f"training on {device} ({world_size} rank{'s' * (world_size > 1)})")
    if ddp:                                                                    # [dist]
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)  # [dist]
    raw = model.module if ddp else model                                       # [dist]
    total = cfg.epochs * (cfg.samples // cfg.batch_size)

    while epoch < cfg.epochs:
        sampler.set_epoch(epoch)                           # a new shuffle each epoch, same on all ranks
        sampler.start = done // world_size                 # the sampler position, per rank
        for x, y in loader:
            if step == cfg.crash_at_step and rank == cfg.crash_rank and attempt == 0:
                raise InjectedFault(f"injected fault: rank {rank} crashes at step {step} "
                                    f"(--crash-at-step, first attempt only)")
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()                                # DDP all-reduces gradients here
            opt.step()
            step, done = step + 1, done + cfg.batch_size
            if step % cfg.log_every == 0:
                mean = loss.detach().clone()
                if ddp:                                                        # [dist]
                    dist.all_reduce(mean)                                      # [dist]
                if master:
                    print(_LOG.format(step=step, total=total, epoch=epoch,
                                      loss=mean.item() / world_size, attempt=attempt), flush=True)
            if done == cfg.samples:
                epoch, done = epoch + 1, 0
            if snaps and cfg.snapshot_every and step % cfg.snapshot_every == 0:
                _snapshot(snaps, raw, opt, cfg, step=step, epoch=epoch, done=done,
                          world_size=world_size, device=device, ddp=ddp, master=master)
            if cfg.step_delay:
                time.sleep(cfg.step_delay)
    params = {k: v.detach().cpu().clone() for k, v in raw.state_dict().items()}
    if snap_dir and master:
        save_snapshot(snap_dir / FINAL, params)
        print(f"done: {step} steps, final parameters in {snap_dir / FINAL}", flush=True)
    return params


def _snapshot(snaps, raw, opt, cfg, *, step: int, epoch: int, done: int, world_size: int,
              device: torch.device, ddp: bool, master: bool) -> None:
    """Save model, optimizer, every rank's RNG and the position (``step``, ``epoch``, ``done``
    samples of it) in one snapshot; rank 0 writes it, the others send it their RNG."""
    rngs = [None] * world_size
    if ddp:                                                                    # [dist]
        dist.all_gather_object(rngs, _rng_state(device))   # every rank's RNG, kept by rank 0  # [dist]
    else:
        rngs = [_rng_state(device)]
    if master:                                              # one writer; everyone reads it back
        t0 = time.perf_counter()
        with snaps.writing(step, meta={"step": step, "world_size": world_size}) as folder:
            save_snapshot(folder / SNAPSHOT, {
                "model": raw.state_dict(), "optimizer": opt.state_dict(), "rng": rngs,
                "step": step, "epoch": epoch, "samples_in_epoch": done, "world_size": world_size,
                "config": {k: v for k, v in vars(cfg).items() if not k.startswith("crash")}})
        print(f"snapshot: step {step} -> {folder} ({time.perf_counter() - t0:.3f} s)", flush=True)


_LOG = "step {step:4d}/{total} | epoch {epoch} | loss {loss:.6f} | attempt {attempt}"
_LOG_RE = re.compile(r"step\s+(\d+)/(\d+) \| epoch (\d+) \| loss ([0-9.eE+-]+|nan|inf) \| attempt (\d+)")


def parse_log(lines) -> list[tuple[int, float, int]]:
    """(step, loss, attempt) for every training log line in ``lines`` (strings), in order.

    >>> parse_log(["step   12/64 | epoch 0 | loss 0.812345 | attempt 1"])
    [(12, 0.812345, 1)]
    """
    out = []
    for line in lines:
        m = _LOG_RE.search(str(line))
        if m:
            out.append((int(m.group(1)), float(m.group(4)), int(m.group(5))))
    return out


@record                          # on failure: the traceback goes into torchrun's error summary
def main(argv: list[str] | None = None) -> None:
    """Entry point: initialise the process group when launched by torchrun, train, tear down."""
    cfg = parse_args(argv)
    torchrun = "RANK" in os.environ and not dist.is_initialized()              # [dist]
    if torchrun:                                                               # [dist]
        backend = "nccl" if torch.cuda.is_available() else "gloo"              # [dist]
        if backend == "nccl":                                                  # [dist]
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))               # [dist]
        dist.init_process_group(backend)   # RANK, WORLD_SIZE, MASTER_* from torchrun  # [dist]
    try:
        train(cfg)
    finally:
        if torchrun:                                                           # [dist]
            dist.destroy_process_group()                                       # [dist]


if __name__ == "__main__":
    run_then_exit(main)   # main(), then os._exit: labkit/portable/ending.py says why  # [dist]
