"""The capstone's text: Python's own standard library, as bytes, in windows (notebook 08, "The data").

No download: the corpus is the interpreter's standard-library sources
(``sysconfig.get_paths()["stdlib"]``), the top-level public modules
(``*.py`` not starting with ``_``) in sorted order, read until ``max_bytes``.
The same interpreter gives the same corpus on every machine and rank; its
:attr:`Corpus.fingerprint` goes into every checkpoint, so a run is never
resumed on other text (another Python version has another standard library).

Tokens are bytes (vocabulary 256), so there is no tokenizer to ship. The
first 90 % of the bytes train, the last 10 % validate. A training example is
one window of ``block_size + 1`` bytes taken at a stride of ``block_size``
(``x`` = the first ``block_size``, ``y`` = the same shifted by one).

>>> c = load_corpus(max_bytes=20_000)
>>> len(c.train) + len(c.val) == 20_000, c.files[0]
(True, 'abc.py')
>>> x, y = Windows(c.train, 8)[0]
>>> bool((x[1:] == y[:-1]).all())
True
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from typing import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["Corpus", "load_corpus", "Windows", "rank_batches", "decode", "encode"]


@dataclass(frozen=True)
class Corpus:
    """Byte tokens for training and validation, and where they came from."""

    train: torch.Tensor          # uint8 -> int64 token ids, 1-D
    val: torch.Tensor
    files: tuple[str, ...]       # names under the stdlib folder, in the order read
    root: str
    fingerprint: str             # sha256 of the bytes: a checkpoint must match it


def load_corpus(max_bytes: int = 1_000_000, val_fraction: float = 0.1,
                root: str | None = None) -> Corpus:
    """Read the standard library's public top-level modules (sorted) up to ``max_bytes`` bytes."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in Path(root).glob("*.py") if not p.name.startswith("_"))
    if not paths:
        raise FileNotFoundError(f"no *.py files in {root}: the capstone trains on the Python "
                                f"standard library's sources, which this interpreter does not "
                                f"ship. Pass --corpus-dir with a folder of .py files.")
    chunks, files, total = [], [], 0
    for p in paths:
        if total >= max_bytes:
            break
        data = p.read_bytes()[: max_bytes - total]
        chunks.append(data)
        files.append(p.name)
        total += len(data)
    raw = b"".join(chunks)
    n_val = max(1, int(len(raw) * val_fraction))
    if len(raw) - n_val < 2:
        raise ValueError(f"--corpus-bytes {max_bytes} leaves no training text; use more.")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return Corpus(tokens[:-n_val], tokens[-n_val:], tuple(files), str(root),
                  hashlib.sha256(raw).hexdigest()[:16])


class Windows(Dataset):
    """Windows of ``block_size + 1`` tokens; item ``i`` starts at token ``i * block_size``."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot make one window of block_size "
                             f"{block_size} + 1: use a smaller --block-size or more "
                             f"--corpus-bytes.")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        w = self.tokens[i * self.block_size: i * self.block_size + self.block_size + 1]
        return w[:-1], w[1:]


Batch = tuple[torch.Tensor, torch.Tensor]


def rank_batches(data: Dataset, batch_size: int, micro_batches: int, rank: int, world_size: int,
                 seed: int, start_step: int = 0) -> Iterator[list[Batch]]:
    """This rank's micro-batches, step by step from ``start_step`` (an endless iterator).

    ``batch_size`` is the GLOBAL batch (windows per optimizer step). Each epoch
    is one ``DistributedSampler`` permutation (``seed + epoch``, the same for any
    world size); rank ``r`` takes every ``world_size``-th window of it, so step
    ``k``'s global batch is windows ``k*B .. (k+1)*B - 1`` of the permutation:
    the SAME set of windows on 1, 2 or 4 ranks. The data position is therefore
    just the step number, and a run resumed on another world size goes on
    with the same data.
    """
    per_rank, steps_per_epoch = batch_size // world_size, len(data) // batch_size
    micro = per_rank // micro_batches
    if steps_per_epoch == 0 or micro == 0 or per_rank * world_size != batch_size \
            or micro * micro_batches != per_rank:
        raise ValueError(f"--batch-size {batch_size} must split evenly over {world_size} ranks x "
                         f"{micro_batches} micro-batches (--grad-accum), and fit in the "
                         f"{len(data)} training windows: use a multiple of "
                         f"{world_size * micro_batches} up to {len(data)}.")
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    step, epoch, order = start_step, None, []
    while True:
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
        k = step % steps_per_epoch
        mine = order[k * per_rank:(k + 1) * per_rank]
        out = []
        for m in range(micro_batches):
            pairs = [data[i] for i in mine[m * micro:(m + 1) * micro]]
            out.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        yield out
        step += 1


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids (int64)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    """Token ids back to text (bytes that are not valid UTF-8 show as U+FFFD)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
