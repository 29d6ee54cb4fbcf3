"""The capstone: a small GPT trained under torchrun that survives failures, shards, proves itself.

Notebook 08 ships this file. One script, like nanoGPT's ``train.py``: it runs
as one process or under torchrun, with ``--parallel ddp`` (DistributedDataParallel)
or ``--parallel fsdp`` (FSDP2 ``fully_shard``: every block's parameters,
gradients and Adam moments split over the ranks). Every line that exists only
for distributed training ends in ``# [dist]``::

    grep -n "\\[dist\\]" labkit/capstone/train_gpt.py     # the whole distributed delta

It trains a byte-level GPT on Python's own standard library (no download),
with gradient accumulation (``--grad-accum``; DDP's ``no_sync()``, FSDP2's
``set_requires_gradient_sync``), optional bf16 autocast (``--bf16``), logs on
rank 0 only, evaluates on every rank (``evaluate.py``: exactly the
one-process number), and writes sharded checkpoints with
torch.distributed.checkpoint (``sharded_checkpoint.py``) that are rotated and
verified (:mod:`labkit.portable.checkpoints`): a run restarted after a crash or a SIGKILL ends
bit-identical to one that never failed; a checkpoint written by 2 ranks loads
on 1 or 4 (the parameters exactly; see "Resharding" in notebook 08 for what
cannot be bit-identical and why). At the end rank 0 writes ``final.pt`` (all
parameters), ``summary.json`` and prints a sample of generated text.

Runbook (from the repository root; ``python -m torch.distributed.run`` is torchrun)::

    # one process: 269 s (about 4.5 min) on the reference machine's busy core (README)
    python -m labkit.capstone.train_gpt --out-dir runs/gpt1
    # 2 ranks, DDP; rank 1 crashes at step 120 (first attempt only), torchrun restarts it
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 \\
      python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=2 \\
      -m labkit.capstone.train_gpt --out-dir runs/gpt2 --crash-rank 1 --crash-at-step 120
    # 2 ranks, FSDP2, bf16 autocast, 4 micro-batches per step
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 \\
      python -m torch.distributed.run --standalone --nproc-per-node=2 \\
      -m labkit.capstone.train_gpt --out-dir runs/gpt3 --parallel fsdp --bf16 --grad-accum 4
    # elastic: 1 to 2 nodes (run on each node; HOST = the first node, shared --out-dir)
    python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 \\
      --rdzv-id=gpt --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
      --rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3 \\
      -m labkit.capstone.train_gpt --out-dir /shared/runs/gpt4

Elastic: a node that leaves makes the others restart with the new WORLD_SIZE
and resume from the newest checkpoint (resharded). The node at HOST serves the
rendezvous and must stay. With the default --rdzv-conf the survivors waited
~39 s to re-form (30 s last call + keep-alive timeouts; torch 2.13, one machine);
with the one above, ~4 s. (A node that arrives after the last call waits, and the
agents restart the group to take it in: ``num_nodes_waiting`` in
torch/distributed/elastic/agent/server/api.py.)

Notebook 08's exercise runs this file with ``--pieces FILE``: a learner's own
``all_reduce_sums``, ``save_checkpoint`` and ``load_checkpoint`` in place of
the ones imported below (``grep -n pieces`` shows the whole hook).

Re-running a command with the same ``--out-dir`` resumes from its newest whole
checkpoint. On gloo set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch
2.13's shared rendezvous store, restarted gloo groups often fail to connect.
In Python: ``train(parse_args([...]))`` inside an initialised process group.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist  # [dist]
from torch.nn.parallel import DistributedDataParallel as DDP  # [dist]
from torch.utils.data import Dataset, Subset

from ..portable.checkpoints import Checkpoints, NoValidCheckpoint
from ..portable.elastic import record   # torch's @record; its error file written whole
from ..portable.ending import run_then_exit  # [dist]
from .data import Windows, decode, encode, load_corpus, rank_batches
from .evaluate import all_reduce_sums, evaluate
from .model import GPTConfig, make_gpt
from .sharded_checkpoint import full_model_state, load_checkpoint, save_checkpoint

__all__ = ["parse_args", "train", "main", "InjectedFault", "FINAL", "SUMMARY", "SAME", "PIECES",
           "use_pieces"]

FINAL, SUMMARY = "final.pt", "summary.json"
# options a resumed run must share with the checkpoint (the rest may change: world size,
# --parallel, --grad-accum, --bf16, logging)
SAME = ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "lr",
        "min_lr", "warmup", "weight_decay", "grad_clip", "seed", "corpus_bytes")


# The exercise hook (notebook 08): the three pieces a learner writes, looked up here at call
# time. ``--pieces FILE`` (a pickle of {name: function}) replaces them for this process.
PIECES = ("all_reduce_sums", "save_checkpoint", "load_checkpoint")


def use_pieces(path: str) -> None:
    """Replace the script's :data:`PIECES` with those pickled in ``path`` (notebook 08's checker).

    The file is written with cloudpickle (functions defined in a notebook travel by value);
    reading it needs cloudpickle installed, as in the lab's environment.
    """
    import pickle

    pieces = pickle.loads(Path(path).read_bytes())
    if not isinstance(pieces, dict) or not set(pieces) <= set(PIECES):
        got = sorted(map(str, pieces)) if isinstance(pieces, dict) else type(pieces).__name__
        raise ValueError(f"--pieces {path}: expected a dict of functions named from {PIECES}, "
                         f"got {got}.")
    globals().update(pieces)                                   # the whole hook


class InjectedFault(RuntimeError):
    """The crash asked for with ``--crash-rank/--crash-at-step`` (first attempt only)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options (``python -m labkit.capstone.train_gpt --help``)."""
    p = argparse.ArgumentParser(prog="python -m labkit.capstone.train_gpt",
                                description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--steps", type=int, default=600, help="optimizer steps in all")
    a("--batch-size", type=int, default=16, help="GLOBAL windows per step (split over ranks)")
    a("--grad-accum", type=int, default=1, help="micro-batches per step on each rank")
    a("--block-size", type=int, default=128, help="context length in bytes")
    a("--n-layer", type=int, default=4)
    a("--n-head", type=int, default=4)
    a("--n-embd", type=int, default=128)
    a("--dropout", type=float, default=0.1)
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--warmup", type=int, default=30)
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--seed", type=int, default=0)
    a("--corpus-bytes", type=int, default=1_000_000)
    a("--corpus-dir", default=None, help="folder of .py files (default: the stdlib)")
    a("--parallel", choices=("ddp", "fsdp"), default="ddp")
    a("--bf16", action="store_true", help="bf16 autocast for forward passes")
    a("--out-dir", default="runs/gpt", help="checkpoints, final.pt, summary.json ('' = none)")
    a("--ckpt-every", type=int, default=50, help="steps between checkpoints (0 = only at the end)")
    a("--keep", type=int, default=2, help="checkpoints kept (the newest K)")
    a("--eval-every", type=int, default=100, help="steps between evaluations (0 = only at the end)")
    a("--eval-windows", type=int, default=64, help="validation windows (0 = all)")
    a("--eval-batch", type=int, default=16)
    a("--log-every", type=int, default=10)
    a("--sample-tokens", type=int, default=300, help="bytes of text generated at the end")
    a("--prompt", default="def ")
    a("--step-delay", type=float, default=0.0, help="sleep per step (seconds)")
    a("--crash-rank", type=int, default=None)
    a("--crash-at-step", type=int, default=None)
    a("--pieces", default=None, help="notebook 08's exercise: a pickle of your " + "/".join(PIECES))
    return p.parse_args(argv)


def lr_at(step: int, cfg: argparse.Namespace) -> float:
    """Linear warmup to ``--lr``, then cosine decay to ``--min-lr`` at ``--steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def wrap(model: torch.nn.Module, parallel: str, world_size: int, device: torch.device):
    """DDP, or FSDP2 (each block sharded on its own, then the rest); as is on one process."""
    if not dist.is_initialized():                                              # [dist]
        return model
    if parallel == "ddp":                                                      # [dist]
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # [dist]
    from torch.distributed.device_mesh import init_device_mesh                 # [dist]
    from torch.distributed.fsdp import fully_shard                            # [dist]
    mesh = init_device_mesh(device.type, (world_size,))   # explicit: CPU stays on gloo  # [dist]
    for block in model.blocks:                                                 # [dist]
        fully_shard(block, mesh=mesh)                                          # [dist]
    return fully_shard(model, mesh=mesh)                                       # [dist]


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, sync: bool):
    """Synchronise gradients in this backward only when ``sync`` (the last micro-batch)."""
    if isinstance(model, DDP) and not sync:                                    # [dist]
        with model.no_sync():                                                  # [dist]
            yield
    elif hasattr(model, "set_requires_gradient_sync"):     # FSDP2                # [dist]
        model.set_requires_gradient_sync(sync)                                 # [dist]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)                             # [dist]
    else:
        yield


def _pick_checkpoint(ckpts: Checkpoints | None, master: bool):
    """Rank 0 finds the newest whole checkpoint; every rank gets the same answer (or error)."""
    answer = [None]
    if ckpts and master:
        try:
            found = ckpts.latest()
            answer = [None if found is None else (str(found.path), found.step, found.meta)]
        except NoValidCheckpoint as e:
            answer = [("error", str(e), None)]
    if dist.is_initialized():                                                  # [dist]
        dist.broadcast_object_list(answer, src=0)   # one decision for all ranks  # [dist]
    if answer[0] and answer[0][0] == "error":
        raise NoValidCheckpoint(answer[0][1], {})
    return answer[0]


def _check_resumable(meta: dict, cfg: argparse.Namespace, corpus: str, where: str) -> None:
    saved = meta["config"]
    for key in SAME:
        if saved.get(key) != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"the checkpoint {where} was made with {flag} {saved.get(key)}, this "
                             f"run has {flag} {getattr(cfg, key)}: resuming would mix two runs. "
                             f"Use the same options, or another --out-dir to start fresh.")
    if meta["corpus"] != corpus:
        raise ValueError(f"the checkpoint {where} was trained on other text (corpus "
                         f"{meta['corpus']}, now {corpus}: another Python version or "
                         f"--corpus-dir). Use another --out-dir to start fresh.")


def _resume(ckpts, cfg, model, opt, device, world: int, corpus: str, log) -> int:
    """Load the newest whole checkpoint (if any) into model and optimizer; return its step."""
    found = _pick_checkpoint(ckpts, master=dist.get_rank() == 0 if dist.is_initialized() else True)
    if found is None:
        return 0
    path, step, meta = found
    _check_resumable(meta, cfg, corpus, path)
    same = meta["world_size"] == world
    load_checkpoint(path, model, opt, device, restore_rng=same)
    log(f"resumed from {path}: step {step}, saved by {meta['world_size']} rank(s) "
        f"({meta['parallel']}), now {world} ({_layout(cfg)}) | attempt {_attempt()}")
    if not same:
        log(f"note: resharded {meta['world_size']} -> {world} ranks: parameters and optimizer "
            f"state are exactly the saved ones; the dropout RNG streams are new and the "
            f"gradients are summed in another order, so the run goes on close to, not "
            f"bit-identical with, a {meta['world_size']}-rank run.")
    return step


def _save(ckpts, step, model, opt, device, cfg, world: int, corpus: str, log) -> None:
    master = not dist.is_initialized() or dist.get_rank() == 0
    t0 = time.perf_counter()
    if master:
        ckpts.prepare(step)
    if dist.is_initialized():                                                  # [dist]
        dist.barrier()              # the folder exists before any rank writes into it  # [dist]
    save_checkpoint(ckpts.folder(step), model, opt, device)
    if master:                      # after dcp.save every rank's file is on disk
        meta = {"step": step, "world_size": world, "parallel": _layout(cfg), "corpus": corpus,
                "config": {k: getattr(cfg, k) for k in SAME}}
        ck = ckpts.commit(step, meta)
        size = sum(f["bytes"] for f in ck.manifest["files"].values())
        log(f"checkpoint: step {step} -> {ck.path} ({len(ck.manifest['files'])} files, "
            f"{size / 1e6:.2f} MB, {time.perf_counter() - t0:.2f} s)")


def _optimizer(model: torch.nn.Module, cfg: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]      # matrices and embeddings
    rest = [p for p in model.parameters() if p.dim() < 2]        # biases and LayerNorm gains
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _layout(cfg: argparse.Namespace) -> str:
    return cfg.parallel if dist.is_initialized() else "one process"                # [dist]


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_LOG = ("step {step:4d}/{total} | epoch {epoch} | loss {loss:.6f} | attempt {attempt} | "
        "lr {lr:.2e} | {tps:.0f} tok/s")


def _setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device): from the process group if there is one, else one process."""
    distributed = dist.is_available() and dist.is_initialized()                # [dist]
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)  # [dist]
    cuda = dist.get_backend() == "nccl" if distributed else torch.cuda.is_available()  # [dist]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return rank, world, torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def _optimizer_step(model, opt, micro: list, cfg, step: int, device) -> torch.Tensor:
    """One step: forward/backward over this rank's micro-batches, clip, update; their mean loss."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss_sum = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro):
        with grad_sync(model, sync=i == len(micro) - 1):   # all-reduce on the last only
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                _, loss = model(x.to(device), y.to(device))
            (loss / len(micro)).backward()
        loss_sum += loss.detach() / len(micro)
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum


def _data(cfg: argparse.Namespace) -> tuple[Windows, Dataset, str]:
    """Training windows, validation windows (the first --eval-windows), the corpus fingerprint."""
    corpus = load_corpus(cfg.corpus_bytes, root=cfg.corpus_dir)
    val = Windows(corpus.val, cfg.block_size)
    if cfg.eval_windows:
        val = Subset(val, range(min(cfg.eval_windows, len(val))))
    return Windows(corpus.train, cfg.block_size), val, corpus.fingerprint


def train(cfg: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Train with ``cfg``; return the final parameters (every one on rank 0, {} on the others)."""
    rank, world, device = _setup()
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)  # rank 0 logs
    train_data, val_data, corpus = _data(cfg)
    gpt = GPTConfig(cfg.block_size, 256, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)
    model = wrap(make_gpt(gpt, seed=cfg.seed).to(device), cfg.parallel, world, device)
    opt = _optimizer(model, cfg)
    torch.manual_seed(cfg.seed + 1000 + rank)              # each rank its own dropout masks
    ckpts = Checkpoints(Path(cfg.out_dir) / "checkpoints", cfg.keep, log) if cfg.out_dir else None
    step = _resume(ckpts, cfg, model, opt, device, world, corpus, log)
    batches = rank_batches(train_data, cfg.batch_size, cfg.grad_accum, rank, world, cfg.seed, step)
    per_epoch, tokens = len(train_data) // cfg.batch_size, cfg.batch_size * cfg.block_size
    timed, t_train, t_start = 0, 0.0, time.perf_counter()
    while step < cfg.steps:
        if step == cfg.crash_at_step and rank == cfg.crash_rank and _attempt() == 0:
            raise InjectedFault(f"injected fault: rank {rank} crashes at step {step} "
                                f"(--crash-at-step, first attempt only)")
        t0 = time.perf_counter()
        loss = _optimizer_step(model, opt, next(batches), cfg, step, device)
        step, timed, t_train = step + 1, timed + 1, t_train + time.perf_counter() - t0
        if step % cfg.log_every == 0 or step == cfg.steps:
            if world > 1:                                                      # [dist]
                dist.all_reduce(loss)       # the global batch's mean loss x world  # [dist]
            log(_LOG.format(step=step, total=cfg.steps, epoch=(step - 1) // per_epoch,
                            loss=loss.item() / world, attempt=_attempt(), lr=lr_at(step - 1, cfg),
                            tps=timed * tokens / t_train))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            result = evaluate(model, val_data, cfg.eval_batch, device, cfg.bf16, all_reduce_sums)
            log(f"eval | step {step} | {result}")
        if ckpts and (step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0)):
            _save(ckpts, step, model, opt, device, cfg, world, corpus, log)
        time.sleep(cfg.step_delay)
    result = evaluate(model, val_data, cfg.eval_batch, device, cfg.bf16, all_reduce_sums)
    log(f"eval | step {step} | {result}")
    params = full_model_state(model)                       # gathered on rank 0 (a collective)
    if rank == 0:
        times = (timed, t_train, time.perf_counter() - t_start)
        _finish(cfg, params, gpt, result, step, world, times, log)
    return params


def _finish(cfg, params, gpt, result, step: int, world: int, times: tuple, log) -> None:
    timed, t_train, wall = times
    tps = timed * cfg.batch_size * cfg.block_size / t_train if timed else None
    if cfg.out_dir:
        torch.save(params, Path(cfg.out_dir) / FINAL)
        summary = {"steps": step, "world_size": world, "parallel": _layout(cfg),
                   "val_loss": result.loss, "val_windows": result.windows,
                   "steps_this_attempt": timed, "train_s": round(t_train, 3),
                   "wall_s": round(wall, 3), "tokens_per_s": tps and round(tps, 1)}
        (Path(cfg.out_dir) / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    if cfg.sample_tokens:
        model = make_gpt(gpt)
        model.load_state_dict(params)
        out = model.eval().generate(encode(cfg.prompt)[None], cfg.sample_tokens,
                                    generator=torch.Generator().manual_seed(cfg.seed))
        log("sample:\n" + decode(out[0]) + "\n[end of sample]")
    log(f"done: {step} steps on {world} rank(s)" + (f", final parameters in "
        f"{Path(cfg.out_dir) / FINAL}" if cfg.out_dir else ""))


@record                          # on failure: the traceback goes into torchrun's error summary
def main(argv: list[str] | None = None) -> None:
    """Entry point: initialise the process group when launched by torchrun, train, tear down."""
    cfg = parse_args(argv)
    if cfg.pieces:
        use_pieces(cfg.pieces)
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
