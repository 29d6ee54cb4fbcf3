"""The runs behind notebook 08's grader: its own reference run, and the learner's script under torchrun.

* :func:`reference` — the project's own code, uninterrupted, on 2 warm lab ranks
  (``lk.run``): the loss of every step, the final parameters, and at every
  checkpoint the whole model and optimizer state and each rank's RNG state.
  Computed once per process and reused by every case.
* :func:`learner_run` — ``torchrun --nproc-per-node=2`` of ``train_gpt.py
  --pieces FILE`` with the learner's pieces (wrapped by :mod:`.probes`; the
  script keeps its own functions for the pieces not given); when asked, rank 1 is
  SIGKILLed after step :data:`KILL_AFTER` and torchrun restarts the group once.
* :func:`start_reshard` — ``torchrun --nproc-per-node=1`` resuming a checkpoint the
  learner's code wrote on 2 ranks (started as soon as that checkpoint exists), a copy
  with every floating-point tensor doubled (:func:`disguise_checkpoint`): a load that
  restores anything but what the folder holds (a file of its own elsewhere) shows.

Every wait has a limit: no output for :data:`STEP_IDLE_S` seconds while steps are
being logged (a deadlocked collective), or for :data:`IDLE_S` seconds otherwise
(startup), stops the job and fails the case; nothing outlives a run.
"""
from __future__ import annotations

import functools
import hashlib
import re
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...runtime import run as run_ranks
from ...runtime.torchrun import Job, Run, TorchrunTimeout, launch
from ...torchrun.train import parse_log
from .probes import Guard, load_probe, reduce_probe

__all__ = ["ARGV", "SCRIPT", "KILL_AFTER", "Reference", "reference", "LearnerRun", "learner_run",
           "start_reshard", "finish", "digest", "ship", "first_error", "doubled",
           "disguise_checkpoint"]

SCRIPT = "labkit.capstone.train_gpt"
# 3000 bytes of text: 84 training windows, 9 validation windows (2 ranks pad one duplicate).
# Checkpoints at steps 3, 6, 8 (all kept); evaluations at 3, 6 and 8 (the end).
ARGV = ["--steps", "8", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--corpus-bytes", "3000", "--log-every", "1", "--ckpt-every", "3",
        "--keep", "3", "--eval-every", "3", "--eval-windows", "0", "--eval-batch", "4",
        "--sample-tokens", "0", "--parallel", "fsdp"]
FIRST_CKPT, EVAL_EVERY, STEPS = 3, 3, 8
KILL_AFTER = 4           # rank 1 is SIGKILLed once rank 0 has logged this step (first attempt)
STEP_DELAY = "0.25"      # seconds between steps: room to kill between two checkpoints
IDLE_S, STEP_IDLE_S, TOTAL_S = 90.0, 25.0, 300.0
ENV = {"CUDA_VISIBLE_DEVICES": ""}      # gloo on CPU, like the reference: bit for bit comparable


# ------------------------------------------------------------------ the reference run
@dataclass
class Reference:
    losses: dict[int, float]           # step -> loss as rank 0 logged it
    final: dict                        # every parameter at the end
    saved: dict[int, dict]             # step -> {"model", "optim", "rng": [rank 0's, rank 1's]}


def _reference_in_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.utils._pytree import tree_map

    from .. import train_gpt as G

    real, saved = G.save_checkpoint, {}

    def recording_save(path, model, opt, device):
        rng = torch.get_rng_state()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_state_dict(model, opt, options=opts)             # a collective
        copy = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)
        saved[int(Path(path).name.split("_")[1])] = {"model": copy[0], "optim": copy[1],
                                                      "rng": rng}
        real(path, model, opt, device)

    G.save_checkpoint = recording_save
    try:
        final = G.train(G.parse_args(argv))
    finally:
        G.save_checkpoint = real
    return {"final": final, "saved": saved}


_REFERENCE: dict[tuple, Reference] = {}
_SHIPPING = threading.Lock()


def reference(work: Path) -> Reference:
    """The uninterrupted run of the project's own code on 2 ranks (cached per process)."""
    key = tuple(ARGV)
    if key not in _REFERENCE:
        out = work / "reference"
        res = run_ranks(_reference_in_rank, 2, args=(ARGV + ["--out-dir", str(out)],),
                        backend="gloo", echo=False, timeout=60, deadline=180)   # CPU, like ENV
        r0, r1 = res.values
        saved = {s: {**r0["saved"][s], "rng": [r0["saved"][s]["rng"], r1["saved"][s]["rng"]]}
                 for s in r0["saved"]}
        losses = {s: loss for s, loss, _ in parse_log(res.stdout[0].splitlines())}
        _REFERENCE.clear()
        _REFERENCE[key] = Reference(losses, r0["final"], saved)
        shutil.rmtree(out, ignore_errors=True)
    return _REFERENCE[key]


# ------------------------------------------------------------------ the learner's runs
def _by_value(pieces: dict, obj) -> bytes:
    """``obj`` pickled with the learner's own modules (e.g. a test's answers module) by value."""
    import cloudpickle

    modules = {getattr(f, "__module__", None) for f in pieces.values()}
    local = [sys.modules[m] for m in modules if m in sys.modules and m != "__main__"
             and not m.startswith("labkit") and "site-packages" not in
             (getattr(sys.modules[m], "__file__", "") or "")]
    # cloudpickle's by-value registry is global: one pickling at a time, or a grading in
    # another thread would pickle by value what this one pickles by reference
    with _SHIPPING:
        for mod in local:
            cloudpickle.register_pickle_by_value(mod)
        try:
            return cloudpickle.dumps(obj)
        finally:
            for mod in local:
                cloudpickle.unregister_pickle_by_value(mod)


def digest(pieces: dict) -> str:
    """What identifies a set of pieces: the hash of their code and data, pickled by value."""
    return hashlib.sha256(_by_value(pieces, pieces)).hexdigest()


def ship(pieces: dict, probe_dir: Path, path: Path) -> Path:
    """Write the ``--pieces`` file: the learner's functions given (by value), eval and load
    probed, the project's own functions guarded (:class:`.Guard`, unpickled first), the
    evaluation's disguise drawn from a secret of this grading."""
    import secrets

    guard, folder = Guard(str(probe_dir)), str(probe_dir)
    probed = {"all_reduce_sums": lambda f: functools.partial(reduce_probe, guard, f, folder,
                                                             secrets.randbits(62)),
              "load_checkpoint": lambda f: functools.partial(load_probe, guard, f, folder)}
    assert any(name in pieces for name in probed), f"nothing to probe in {sorted(pieces)}"
    # the probed pieces first: a pickle loads in order, so the guard is in place before any
    # of the learner's functions (and what they name) is loaded; the script keeps its own
    # functions for the pieces not given
    shipped = {name: probe(pieces[name]) for name, probe in probed.items() if name in pieces}
    shipped.update({name: f for name, f in pieces.items() if name not in probed})
    path.write_bytes(_by_value(pieces, shipped))
    return path


@dataclass
class LearnerRun:
    run: Run | None                    # None: it could not even start
    out: Path                          # --out-dir (checkpoints, final.pt)
    probes: Path
    killed: bool = False
    killed_at: float = -1.0            # when (seconds into the job) the checker sent SIGKILL
    stuck: str = ""                    # why the checker stopped it ("" if it ended by itself)
    notes: list[str] = field(default_factory=list)


def _is_step(line) -> bool:
    return line.source == "rank" and bool(parse_log([line.text]))


def _failed(line) -> bool:
    return line.source == "agent" and ("failed (exitcode" in line.text
                                       or "Worker group FAILED" in line.text)


def _follow(job: Job, until=None):
    """Follow ``job`` to the first line matching ``until`` (or to its end: None), with limits."""
    import time

    end = time.monotonic() + TOTAL_S
    while True:
        last = job.lines[-1] if job.lines else None
        idle = STEP_IDLE_S if last is not None and _is_step(last) else IDLE_S
        try:
            line = job.follow(until=lambda ln: True,
                              timeout=max(1.0, min(idle, end - time.monotonic())))
        except TorchrunTimeout:
            step = last is not None and _is_step(last)
            raise TorchrunTimeout(
                f"no output for {idle:.0f} s " + ("after rank 0 logged a step: a deadlock? (a "
                "collective that only some ranks call, e.g. all_reduce or dcp.save on rank 0 "
                "only)" if step else "while starting or resuming: a deadlock in "
                "load_checkpoint, or a very slow machine") + f". Last line: "
                f"{last.text if last else '(none)'}") from None
        if line is None or (until is not None and until(line)):
            return line


def _finish(job: Job, result: LearnerRun) -> LearnerRun:
    """Follow ``job`` to its end (within the limits) and keep its :class:`Run`."""
    try:
        _follow(job)
    except TorchrunTimeout as e:
        job.stop()
        result.stuck = str(e)
    result.run = job.wait(5)
    return result


def learner_run(pieces: dict, work: Path, kill: bool,
                on_kill: Callable[[], None] | None = None) -> LearnerRun:
    """torchrun on 2 ranks with the learner's pieces; with ``kill``, SIGKILL rank 1 after step
    KILL_AFTER (the steps then paced by STEP_DELAY, room to kill between two checkpoints).

    ``on_kill`` is called right after the kill (the 1-rank run starts then, while torchrun
    restarts this one: the two overlap).
    """
    out, probe_dir = work / "run", work / "probes"
    probe_dir.mkdir(parents=True, exist_ok=True)
    shipped = ship(pieces, probe_dir, work / "pieces.pkl")
    args = ARGV + ["--out-dir", str(out), "--pieces", str(shipped)]
    args += ["--step-delay", STEP_DELAY] if kill else []
    job = launch(SCRIPT, args, nproc_per_node=2, max_restarts=1 if kill else 0, echo=False,
                 env=ENV)
    result = LearnerRun(None, out, probe_dir)
    if kill:
        try:
            hit = _follow(job, lambda ln: _failed(ln) or (_is_step(ln) and any(
                s >= KILL_AFTER and a == 0 for s, _, a in parse_log([ln.text]))))
        except TorchrunTimeout as e:
            job.stop()
            result.stuck = str(e)
            hit = None
        if hit is not None and _failed(hit):
            job.stop()            # it failed by itself: a restart would only fail again
        elif hit is not None:
            job.kill(1)
            result.killed = True
            result.killed_at = job.lines[-1].t
            if on_kill is not None:
                on_kill()
    return _finish(job, result)


def doubled(obj):
    """``obj`` with every floating-point tensor in it times 2 (exact); nothing else changed."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v, obj)


def disguise_checkpoint(folder: Path) -> list[str]:
    """Double every floating-point tensor that checkpoint ``folder`` holds (a DCP checkpoint,
    torch.save files) and commit it again; what was changed ([]: nothing the checker reads)."""
    import json
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from ...portable.checkpoints import MANIFEST, Checkpoints

    changed = []
    for path in sorted(folder.rglob("*.pt")):
        try:
            obj = torch.load(path, weights_only=False)
        except Exception:  # noqa: BLE001  (not a torch.save file: left as it is)
            continue
        torch.save(doubled(obj), path)
        changed.append(path.name)
    if (folder / ".metadata").exists():
        with tempfile.TemporaryDirectory() as tmp:
            whole = Path(tmp) / "whole.pt"
            dcp_to_torch_save(folder, whole)
            torch.save(doubled(torch.load(whole, weights_only=False)), whole)
            for path in folder.iterdir():
                if path.name == ".metadata" or path.suffix == ".distcp":
                    path.unlink()
            torch_save_to_dcp(whole, folder)
        changed.append("the DCP checkpoint")
    manifest = json.loads((folder / MANIFEST).read_text())
    Checkpoints(folder.parent, keep=1 << 20).commit(manifest["step"], manifest["meta"])
    return changed


def start_reshard(pieces: dict, work: Path, checkpoint: Path) -> tuple[Job, LearnerRun]:
    """Start torchrun on 1 rank resuming a disguised copy of ``checkpoint`` (written by 2
    ranks, see :func:`disguise_checkpoint`); finish() it. ``notes``: what the copy is."""
    out, probe_dir = work / "run", work / "probes"
    probe_dir.mkdir(parents=True, exist_ok=True)
    copy = out / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    try:
        notes = [f"doubled: {', '.join(changed)}" if (changed := disguise_checkpoint(copy))
                 else "not disguised: the folder holds no DCP checkpoint or torch.save file"]
    except Exception as e:  # noqa: BLE001  (the learner's files: anything can be wrong)
        notes = [f"not disguised: the checker could not read the checkpoint ({type(e).__name__}:"
                 f" {e})"]
    shipped = ship(pieces, probe_dir, work / "pieces.pkl")
    args = ARGV + ["--out-dir", str(out), "--pieces", str(shipped)]
    return launch(SCRIPT, args, nproc_per_node=1, echo=False, env=ENV), LearnerRun(
        None, out, probe_dir, notes=notes)


def finish(started: tuple[Job, LearnerRun]) -> LearnerRun:
    """Follow a started run to its end, within the limits."""
    return _finish(*started)


_ERROR = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Fault|Interrupt|Timeout))(?::|$)")


def first_error(run: Run | None, after: float = -1.0) -> str:
    """The first exception line any rank printed after ``after`` seconds ("" if none)."""
    if run is None:
        return ""
    for line in run.lines:
        if line.source == "rank" and line.t > after and _ERROR.match(line.text.strip()):
            return f"rank {line.rank}: {line.text.strip()}"
    return ""
