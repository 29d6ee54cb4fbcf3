"""What the capstone tests share: a tiny configuration, in-process and on-ranks runs, comparisons."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

import labkit as lk
from conftest import assert_no_ranks_left
from labkit.capstone import train_gpt as G

# 3000 bytes of abc.py: 84 training windows of 32 bytes, so an epoch is 10 steps of 8 windows
# (12 steps cross an epoch boundary) and 9 validation windows (2, 3, 4 ranks all pad).
TINY = ["--steps", "12", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--corpus-bytes", "3000", "--log-every", "1", "--ckpt-every", "4",
        "--eval-every", "0", "--eval-windows", "0", "--eval-batch", "4", "--sample-tokens", "0"]


def equal(a, b) -> bool:
    """Exactly equal, recursively (dicts, lists, tensors with torch.equal, plain values)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def quiet_train(argv: list[str]) -> tuple[dict, str]:
    """Train in this process (no process group); return (final parameters, rank 0's log)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        params = G.train(G.parse_args(argv))
    return params, out.getvalue()


def _train_in_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    return G.train(G.parse_args(argv))


def on_ranks(argv: list[str], world_size: int = 2, check: bool = True):
    """Train on ``world_size`` warm lab ranks (lk.run, gloo): the JobResult."""
    return lk.run(_train_in_rank, world_size, args=(argv,), echo=False, check=check,
                  timeout=60, deadline=120)


def losses(log: str) -> dict[int, float]:
    return {s: loss for s, loss, _ in lk.train.parse_log(log.splitlines())}


@pytest.fixture(scope="session")
def no_ranks_at_the_end():
    """Warm lab ranks stay between jobs and test files (that is the point of them: a cold start
    costs seconds); when the session ends none is left."""
    yield
    lk.shutdown()
    assert_no_ranks_left()


def steps_saved(out_dir: str | Path) -> list[int]:
    return [s for s, _ in G.Checkpoints(Path(out_dir) / "checkpoints").folders()]
