"""Shared fixtures: every multi-process test checks that no rank outlives its job."""
from __future__ import annotations

import os
import time

import psutil
import pytest

import labkit as lk


def lab_processes() -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(zygotes, ranks) of this process: zygotes are children, ranks grandchildren."""
    zygotes, ranks = [], []
    for child in psutil.Process().children():
        try:
            if any("labkit._zygote" in part for part in child.cmdline()):
                zygotes.append(child)
                ranks.extend(child.children())
        except psutil.NoSuchProcess:
            pass
    return zygotes, ranks


def live_ranks() -> list[psutil.Process]:
    alive = []
    for p in lab_processes()[1]:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def zombies() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_ranks_left(within: float = 3.0) -> None:
    """After a failed job every rank must be gone (killed and reaped), no zombie left."""
    end = time.monotonic() + within
    while (live_ranks() or zombies()) and time.monotonic() < end:
        time.sleep(0.05)
    assert live_ranks() == [], f"ranks left running: {live_ranks()}"
    assert zombies() == [], f"zombie processes: {zombies()}"


def has_gpus(n: int) -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.device_count() >= n
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.gpu
needs_gpus = lambda n: pytest.mark.skipif(not has_gpus(n), reason=f"needs {n} CUDA GPUs")  # noqa: E731

os.environ.setdefault("LABKIT_PRESTART", "0")
