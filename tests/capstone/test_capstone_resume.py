"""Capstone resume: bit for bit after a crash, on a damaged disk, under DDP and FSDP2 (one process and lab ranks).

Real torchrun restarts (crash, SIGKILL, a node leaving) are in test_capstone_torchrun.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import labkit as lk
from capstone_common import (TINY, equal, losses, max_diff, no_ranks_at_the_end,
                             on_ranks, quiet_train)
from labkit.capstone import train_gpt as G

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, str]:
    return quiet_train(TINY + ["--out-dir", str(tmp_path_factory.mktemp("full"))])


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A run that crashed at step 11: checkpoints at steps 4 and 8 (keep 2)."""
    out = tmp_path_factory.mktemp("crashed")
    with pytest.raises(G.InjectedFault, match="rank 0 crashes at step 11"):
        quiet_train(TINY + ["--out-dir", str(out), "--crash-rank", "0", "--crash-at-step", "11"])
    return out


def _copy(crashed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(crashed, out)
    return out


def test_resume_in_one_process_is_bit_identical(tmp_path, crashed, uninterrupted):
    out = _copy(crashed, tmp_path)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004",
                                                                        "step_00000008"]
    params, log = quiet_train(TINY + ["--out-dir", str(out)])
    assert "resumed from" in log and "step_00000008: step 8, saved by 1 rank(s)" in log
    full_params, full_log = uninterrupted
    assert sorted(losses(log)) == list(range(9, 13))          # crosses the epoch boundary at 10
    assert all(losses(full_log)[s] == loss for s, loss in losses(log).items())
    assert equal(params, full_params)
    assert equal(torch.load(out / G.FINAL), full_params)


def _without(part: str):
    """A load_checkpoint that forgets one part of the state (negative controls)."""
    real = G.load_checkpoint

    def partial(path, model, opt, device, restore_rng=True):
        real(path, model, opt, device, restore_rng=restore_rng and part != "rng")
        if part == "optimizer":
            opt.state.clear()
    return partial


@pytest.mark.parametrize("part", ["rng", "optimizer", "data position"])
def test_resume_without_part_of_the_state_differs(tmp_path, crashed, uninterrupted, monkeypatch,
                                                  part):
    """The bit-for-bit test above would fail if the RNG, the optimizer or the data position were lost."""
    out = _copy(crashed, tmp_path)
    if part == "data position":
        real = G.rank_batches
        monkeypatch.setattr(G, "rank_batches", lambda *a: real(*a[:-1], 0))
    else:
        monkeypatch.setattr(G, "load_checkpoint", _without(part))
    params, _ = quiet_train(TINY + ["--out-dir", str(out)])
    assert not equal(params, uninterrupted[0])


def _cut(at):
    return lambda p: p.write_bytes(p.read_bytes()[:at(p.stat().st_size)])


def _zero(start, length):
    def damage(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[start:start + length] = bytes(len(data[start:start + length]))
        p.write_bytes(bytes(data))
    return damage


DAMAGE = {  # name: (file in the newest checkpoint, damage, words the log must say)
    "shard truncated to 0": ("__0_0.distcp", _cut(lambda n: 0), "truncated"),
    "shard truncated by 1 byte": ("__0_0.distcp", _cut(lambda n: n - 1), "truncated"),
    "shard truncated at half": ("__0_0.distcp", _cut(lambda n: n // 2), "truncated"),
    "shard zero-filled": ("__0_0.distcp", _zero(0, 1 << 30), "checksum mismatch"),
    "4 KiB zeroed mid-shard": ("__0_0.distcp", _zero(100_000, 4096), "checksum mismatch"),
    "metadata truncated": (".metadata", _cut(lambda n: n // 3), "truncated"),
    "metadata deleted": (".metadata", Path.unlink, "missing (deleted"),
    "shard deleted": ("__0_0.distcp", Path.unlink, "missing (deleted"),
    "manifest deleted": ("MANIFEST.json", Path.unlink, "missing (the save did not finish"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_and_still_ends_bit_identical(
        tmp_path, crashed, uninterrupted, case):
    out = _copy(crashed, tmp_path)
    name, damage, words = DAMAGE[case]
    victim = out / "checkpoints" / "step_00000008" / name
    damage(victim)
    params, log = quiet_train(TINY + ["--out-dir", str(out)])
    assert f"checkpoint {victim.parent} is not usable: {victim}: {words}" in log
    assert "step_00000004: step 4" in log
    assert equal(params, uninterrupted[0])


def test_with_no_whole_checkpoint_the_error_names_the_files(tmp_path, crashed):
    out = _copy(crashed, tmp_path)
    ck = out / "checkpoints"
    DAMAGE["shard zero-filled"][1](ck / "step_00000004" / "__0_0.distcp")
    (ck / "step_00000008" / ".metadata").unlink()
    with pytest.raises(G.NoValidCheckpoint) as err:
        quiet_train(TINY + ["--out-dir", str(out)])
    assert str(ck / "step_00000004" / "__0_0.distcp") in str(err.value)
    assert str(ck / "step_00000008" / ".metadata") in str(err.value)


@pytest.mark.slow
def test_fsdp_on_two_ranks_resumes_bit_identically_from_a_damaged_disk(tmp_path):
    """FSDP2 shards: rank 1's file of the newest checkpoint is truncated; both ranks fall back."""
    argv = TINY + ["--parallel", "fsdp"]
    full = on_ranks(argv + ["--out-dir", ""]).values[0]
    run = argv + ["--out-dir", str(tmp_path)]
    with pytest.raises(lk.RankError, match="InjectedFault"):
        on_ranks(run + ["--crash-rank", "1", "--crash-at-step", "11"])
    shard = tmp_path / "checkpoints" / "step_00000008" / "__1_0.distcp"
    DAMAGE["shard truncated at half"][1](shard)
    res = on_ranks(run)
    assert f"{shard}: truncated" in res.stdout[0] and "step_00000004: step 4" in res.stdout[0]
    assert res.stdout[1] == ""                                   # rank 0 logs, alone
    assert equal(res.values[0], full)


@pytest.mark.slow
def test_every_rank_stops_with_the_same_named_error(tmp_path):
    run = TINY + ["--out-dir", str(tmp_path), "--steps", "4"]
    on_ranks(run)
    (tmp_path / "checkpoints" / "step_00000004" / "__1_0.distcp").unlink()
    res = on_ranks(run, check=False)
    assert [r.status for r in res.ranks] == ["raised", "raised"]
    for r in res.ranks:
        assert "NoValidCheckpoint" in r.error and "__1_0.distcp: missing" in r.traceback


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_like_one_process_on_the_global_batch(parallel):
    """FSDP2 on gloo is correct in torch 2.13 (FIELD_NOTES): 2 ranks match one process."""
    argv = TINY + ["--out-dir", "", "--dropout", "0", "--steps", "6"]
    single, _ = quiet_train(argv)
    two = on_ranks(argv + ["--parallel", parallel]).values[0]
    assert 0 < max_diff(two, single) < 1e-5     # the same math; sums in another order
    accum = on_ranks(argv + ["--parallel", parallel, "--grad-accum", "2"]).values[0]
    assert max_diff(accum, single) < 1e-5
