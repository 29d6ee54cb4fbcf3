"""Checkpoints that survive a bad disk: keep the last K, prove each one whole, fall back.

Notebook 05 teaches it with the lab's training script (:mod:`labkit.torchrun.train`, one
``torch.save`` file per checkpoint); notebook 08's capstone uses it for sharded DCP checkpoints.

A checkpoint is a folder ``step_00000040/`` holding whatever files the writer
makes (DCP's ``__0_0.distcp``, ``__1_0.distcp``, ``.metadata``; or one
``torch.save`` file) and, written LAST, ``MANIFEST.json``: the size and
SHA-256 of every file, plus the run's own metadata (step, world size,
config). The manifest is written to a temporary name, fsynced and renamed,
so it either exists whole or not at all: a folder without one is a save that
never finished. On resume :meth:`Checkpoints.latest` checks the newest folder
against its manifest (missing file, wrong size = truncated, wrong checksum =
overwritten or zero-filled); a damaged one is skipped with a log line that
names the folder, the file and the cause, and the next older one is tried.
When checkpoints exist but none is whole, :class:`NoValidCheckpoint` lists
every folder and file with its problem, and the run stops with that instead
of crashing at the same spot on every restart.

Only the newest ``keep`` committed checkpoints stay (default 2: while one is
being written, or when the newest is damaged, another whole one exists).

Plain Python and hashlib only, so any training script can use it: with DCP
(``labkit/capstone/train_gpt.py``: every rank writes, rank 0 commits) or with
one ``torch.save`` file::

    ckpts = Checkpoints("runs/x", keep=3)
    with ckpts.writing(step, meta={"step": step}) as folder:
        torch.save(state, folder / "snapshot.pt")
    found = ckpts.latest()          # None, or a Checkpoint(path, step, manifest)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["Checkpoints", "Checkpoint", "NoValidCheckpoint", "MANIFEST", "problems"]

MANIFEST = "MANIFEST.json"
_FOLDER = re.compile(r"^step_(\d{8})$")
_FORMAT = "labkit-checkpoint/1"


class NoValidCheckpoint(RuntimeError):
    """Checkpoints exist, but none matches its manifest; ``damaged`` maps folder -> problems."""

    def __init__(self, msg: str, damaged: dict[str, list[str]]):
        super().__init__(msg)
        self.damaged = damaged


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder that matched its manifest when it was looked at."""

    path: Path
    step: int
    manifest: dict

    @property
    def meta(self) -> dict:
        return self.manifest.get("meta", {})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(".tmp"))


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):          # not every file system lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def problems(folder: str | Path) -> list[str]:
    """What is wrong with checkpoint ``folder`` ([] when every file matches its manifest)."""
    folder = Path(folder)
    mpath = folder / MANIFEST
    if not mpath.exists():
        return [f"{mpath}: missing (the save did not finish: a crash or a full disk mid-write)"]
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable ({type(e).__name__}: {e})"]
    out = []
    for rel, want in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            out.append(f"{path}: missing (deleted after the save)")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            out.append(f"{path}: truncated or grown ({size} bytes, the manifest says "
                       f"{want['bytes']})")
        elif _sha256(path) != want["sha256"]:
            out.append(f"{path}: checksum mismatch (same size, other bytes: overwritten or "
                       f"zero-filled)")
    return out


class Checkpoints:
    """The checkpoint folders under ``root``: write, commit, rotate, find the newest whole one.

    Args:
        root: the run's checkpoint folder (created on first save).
        keep: how many committed checkpoints to keep (>= 1; default 2).
        log: where fall-back messages go (default ``print``; rank 0's logger in a script).
    """

    def __init__(self, root: str | Path, keep: int = 2, log: Callable[[str], None] = print):
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint (2 or more lets a run "
                             f"fall back when the newest is damaged).")
        self.root, self.keep, self.log = Path(root), keep, log

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def folders(self) -> list[tuple[int, Path]]:
        """(step, folder) of every checkpoint folder, committed or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if p.is_dir() and (m := _FOLDER.match(p.name))]
        return sorted(found)

    def prepare(self, step: int) -> Path:
        """An empty folder for ``step`` (removes a half-written one left by a crashed attempt)."""
        path = self.folder(step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, meta: dict | None = None) -> Checkpoint:
        """Record size and SHA-256 of each file in ``step``'s folder, write the manifest, rotate."""
        path = self.folder(step)
        files = {}
        for p in _files(path):
            with open(p, "rb") as f:          # the bytes must be on disk before the manifest
                os.fsync(f.fileno())
            files[p.relative_to(path).as_posix()] = {"bytes": p.stat().st_size,
                                                     "sha256": _sha256(p)}
        if not files:
            raise FileNotFoundError(f"{path} holds no files: nothing was saved for step {step}.")
        manifest = {"format": _FORMAT, "step": step, "files": files, "meta": dict(meta or {})}
        tmp = path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MANIFEST)       # atomic: the manifest exists whole or not at all
        _fsync_dir(path)
        self.rotate()
        return Checkpoint(path, step, manifest)

    @contextlib.contextmanager
    def writing(self, step: int, meta: dict | None = None) -> Iterator[Path]:
        """One writer: ``with ckpts.writing(step) as folder: torch.save(..., folder / "x.pt")``."""
        path = self.prepare(step)
        yield path                              # an exception here leaves no manifest: not whole
        self.commit(step, meta)

    def rotate(self) -> list[Path]:
        """Delete all but the newest ``keep`` committed checkpoints, and stale unfinished saves."""
        found = self.folders()
        committed = [(s, p) for s, p in found if (p / MANIFEST).exists()]
        keep = {p for _, p in committed[-self.keep:]}
        done = {p for _, p in committed}
        newest = committed[-1][0] if committed else -1
        gone = [p for s, p in found if p not in keep and (p in done or s < newest)]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that matches its manifest; None when there are no checkpoints.

        Raises :class:`NoValidCheckpoint` (naming every folder and file) when
        there are checkpoints but none is whole.
        """
        found = self.folders()
        damaged: dict[str, list[str]] = {}
        for step, path in reversed(found):
            bad = problems(path)
            if not bad:
                manifest = json.loads((path / MANIFEST).read_text())
                return Checkpoint(path, step, manifest)
            damaged[str(path)] = bad
            self.log(f"checkpoint {path} is not usable: {'; '.join(bad)}. Falling back to an "
                     f"older checkpoint.")
        if not found:
            return None
        lines = "\n".join(f"  {p}" for bad in damaged.values() for p in bad)
        raise NoValidCheckpoint(
            f"no usable checkpoint in {self.root}: all {len(found)} are damaged or incomplete:\n"
            f"{lines}\nNothing can be resumed from them. Restore the folder from a backup, or "
            f"move it away (or pass another checkpoint folder) to start the run from step 0.",
            damaged)
