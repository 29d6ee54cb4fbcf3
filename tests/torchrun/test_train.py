"""labkit.torchrun.train: the training script's pieces, resume bit for bit in one process and on lk.run ranks.

torchrun itself (restarts, SIGKILL, two agents) is tested in test_torchrun.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import torch

import labkit as lk
from conftest import needs_gpus
from labkit.torchrun import check as TC
from labkit.torchrun import train as T

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:Unable to enable fault handler")]


def quiet_train(argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        params = T.train(T.parse_args(argv))
    return params, out.getvalue()


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return quiet_train(["--snapshot-dir", str(tmp_path_factory.mktemp("full"))])[0]


def test_dataset_is_deterministic_and_balanced():
    a, b = T.make_dataset(), T.make_dataset()
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert a.tensors[0].shape == (1024, 2) and a.tensors[0].dtype == torch.float32
    assert torch.bincount(a.tensors[1]).tolist() == [342, 341, 341]
    assert not torch.equal(T.make_dataset(seed=1).tensors[0], a.tensors[0])


def test_model_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    m1, m2 = T.make_model(), T.make_model()
    assert torch.equal(torch.get_rng_state(), before)
    assert equal(m1.state_dict(), m2.state_dict())
    assert not equal(m1.state_dict(), T.make_model(seed=1).state_dict())


def test_snapshot_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / T.SNAPSHOT
    T.save_snapshot(path, {"step": 8, "w": torch.ones(3)})
    assert [p.name for p in tmp_path.iterdir()] == [T.SNAPSHOT]

    def dies_mid_write(obj, f):
        f.write(b"half a snapshot")
        raise OSError("disk full")
    monkeypatch.setattr(T.torch, "save", dies_mid_write)
    with pytest.raises(OSError):
        T.save_snapshot(path, {"step": 16, "w": torch.zeros(3)})
    monkeypatch.undo()
    snap = torch.load(path, weights_only=True)  # the previous file is intact
    assert snap["step"] == 8 and torch.equal(snap["w"], torch.ones(3))


def test_snapshots_keep_the_newest_k_each_with_its_manifest(tmp_path):
    quiet_train(["--snapshot-dir", str(tmp_path), "--epochs", "1", "--keep", "3"])   # 16 steps
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["step_00000008", "step_00000016"]
    quiet_train(["--snapshot-dir", str(tmp_path / "b"), "--epochs", "2", "--keep", "2"])
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.is_dir()) == \
        ["step_00000024", "step_00000032"]
    assert all((tmp_path / "b" / f / "MANIFEST.json").exists() for f in ("step_00000024",
                                                                       "step_00000032"))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


DAMAGE = {"truncated": _truncate, "zero-filled": _zero_fill, "deleted": Path.unlink}


@pytest.mark.parametrize("crash_at, newest, fallback", [(21, 16, 8), (45, 40, 32)])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_snapshot_falls_back_and_ends_bit_identical(
        tmp_path, uninterrupted, crash_at, newest, fallback, damage):
    with pytest.raises(T.InjectedFault):
        quiet_train(["--snapshot-dir", str(tmp_path), "--crash-rank", "0",
                     "--crash-at-step", str(crash_at)])
    bad = tmp_path / f"step_{newest:08d}" / T.SNAPSHOT
    DAMAGE[damage](bad)
    params, log = quiet_train(["--snapshot-dir", str(tmp_path)])
    assert f"checkpoint {bad.parent} is not usable: {bad}" in log, log   # names the file
    assert f"step {fallback}, " in log.split("resumed from", 1)[1].split("\n", 1)[0]
    assert equal(params, uninterrupted)


def test_with_no_whole_snapshot_the_run_stops_naming_every_file(tmp_path):
    with pytest.raises(T.InjectedFault):
        quiet_train(["--snapshot-dir", str(tmp_path), "--crash-rank", "0", "--crash-at-step", "21"])
    _truncate(tmp_path / "step_00000016" / T.SNAPSHOT)
    _zero_fill(tmp_path / "step_00000008" / T.SNAPSHOT)
    with pytest.raises(T.NoValidCheckpoint) as info:
        quiet_train(["--snapshot-dir", str(tmp_path)])
    msg = str(info.value)
    assert "all 2 are damaged" in msg and "truncated" in msg and "checksum mismatch" in msg
    assert str(tmp_path / "step_00000016" / T.SNAPSHOT) in msg
    assert str(tmp_path / "step_00000008" / T.SNAPSHOT) in msg


def test_resume_in_one_process_is_bit_identical(tmp_path, uninterrupted):
    with pytest.raises(T.InjectedFault, match="rank 0 crashes at step 21"):
        quiet_train(["--snapshot-dir", str(tmp_path), "--crash-rank", "0", "--crash-at-step", "21"])
    assert T.load_snapshot(tmp_path, log=lambda msg: None)["step"] == 16
    params, log = quiet_train(["--snapshot-dir", str(tmp_path)])
    assert "resumed from" in log and "step 16, epoch 1, sample 0" in log
    assert [s for s, _, _ in T.parse_log(log.splitlines())] == list(range(17, 65))
    assert equal(params, uninterrupted)
    assert equal(T.load_final(tmp_path), uninterrupted)


@pytest.mark.parametrize("broken", ["rng", "optimizer", "sampler"])
def test_resume_without_part_of_the_snapshot_differs(tmp_path, uninterrupted, monkeypatch, broken):
    """Negative controls: the bit-for-bit test above fails when a snapshot part is not restored."""
    with pytest.raises(T.InjectedFault):
        quiet_train(["--snapshot-dir", str(tmp_path), "--crash-rank", "0", "--crash-at-step", "12"])
    restore = T._restore

    def partial(snap, model, opt, rank, world_size, device):
        fresh = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        step, epoch, done = restore(snap, model, fresh if broken == "optimizer" else opt,
                                    rank, world_size, device)
        if broken == "rng":
            torch.manual_seed(1000)
        return step, epoch, 0 if broken == "sampler" else done
    monkeypatch.setattr(T, "_restore", partial)
    params, _ = quiet_train(["--snapshot-dir", str(tmp_path)])
    assert not equal(params, uninterrupted)


def test_a_snapshot_of_another_run_is_refused(tmp_path):
    with pytest.raises(T.InjectedFault):
        quiet_train(["--snapshot-dir", str(tmp_path), "--crash-rank", "0", "--crash-at-step", "9"])
    with pytest.raises(ValueError, match="made with --batch-size 64, this run has --batch-size 32"):
        quiet_train(["--snapshot-dir", str(tmp_path), "--batch-size", "32"])
    params, log = quiet_train(["--snapshot-dir", str(tmp_path), "--epochs", "5"])  # longer: fine
    assert "step 8," in log and "done: 80 steps" in log


def test_resumable_sampler_continues_the_same_order():
    data = T.make_dataset(64)
    full = [list(T.ResumableSampler(data, 2, r, seed=0)) for r in range(2)]
    s = T.ResumableSampler(data, 2, 1, seed=0)
    s.start = 10
    assert list(s) == full[1][10:] and len(s) == 22
    s.set_epoch(1)
    assert list(s)[:3] != full[1][10:13]


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="multiple of 3"):
        T._check_sizes(T.parse_args(["--batch-size", "64"]), 3)
    with pytest.raises(ValueError, match="--samples 1000 must be a multiple"):
        T._check_sizes(T.parse_args(["--samples", "1000"]), 1)


def test_load_final_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="did not finish"):
        T.load_final(tmp_path)


def test_parse_log_reads_the_script_format():
    line = T._LOG.format(step=7, total=64, epoch=0, loss=0.5, attempt=2)
    assert T.parse_log(["noise", line]) == [(7, 0.5, 2)]


def test_the_ddp_delta_stays_small():
    """nanoGPT-style: the lines that exist only for DDP are few and marked."""
    src = Path(T.__file__).read_text().splitlines()
    marked = [ln for ln in src if ln.rstrip().endswith("# [dist]")]
    assert 10 <= len(marked) <= 25
    assert any("DDP(model" in ln for ln in marked)
    assert any("destroy_process_group" in ln for ln in marked)


def test_main_runs_as_one_process(tmp_path, uninterrupted, capsys):
    T.main(["--snapshot-dir", str(tmp_path), "--log-every", "64"])
    out = capsys.readouterr().out
    assert re.search(r"step\s+64/64", out) and "done: 64 steps" in out
    assert equal(T.load_final(tmp_path), uninterrupted)


@pytest.mark.slow
def test_ddp_on_two_ranks_matches_one_process_on_the_global_batch():
    ddp = TC.reference(["--dropout", "0"], world_size=2)
    single, _ = quiet_train(["--snapshot-dir", "", "--dropout", "0"])
    diff = max((ddp[k] - single[k]).abs().max().item() for k in single)
    assert 0 < diff < 1e-5     # the same math; the all-reduce sums in another order
    assert equal(TC.reference(["--dropout", "0"], world_size=2), ddp)   # deterministic


@pytest.mark.slow
def test_resume_on_lab_ranks_is_bit_identical(tmp_path):
    argv = ["--snapshot-dir", str(tmp_path), "--epochs", "2", "--log-every", "1000"]
    with pytest.raises(lk.RankError, match="InjectedFault"):
        lk.run(TC._train_in_rank, 2, args=(argv + ["--crash-rank", "1", "--crash-at-step", "20"],),
               echo=False)
    res = lk.run(TC._train_in_rank, 2, args=(argv,), echo=False)
    assert "resumed from" in res.stdout[0] and "step 16" in res.stdout[0]
    assert equal(res.values[0], res.values[1])
    assert equal(res.values[0], TC.reference(["--epochs", "2"], world_size=2))


@pytest.mark.slow
def test_a_snapshot_from_two_ranks_resumes_on_one(tmp_path):
    """Elastic: the world size may change between attempts; the data order stays the same."""
    argv = ["--snapshot-dir", str(tmp_path), "--epochs", "2", "--log-every", "1000"]
    with pytest.raises(lk.RankError):
        lk.run(TC._train_in_rank, 2, args=(argv + ["--crash-rank", "0", "--crash-at-step", "10"],),
               echo=False)
    params, log = quiet_train(argv)
    assert "snapshot from 2 ranks, now 1" in log and "step 8" in log
    assert all(torch.isfinite(v).all() for v in params.values())


@needs_gpus(1)
@pytest.mark.gpu
def test_one_process_on_a_gpu(tmp_path):
    params, log = quiet_train(["--snapshot-dir", str(tmp_path), "--epochs", "1"])
    assert "training on cuda:0 (1 rank)" in log, log            # it trained on the GPU,
    assert "done: 16 steps" in log and all(v.device.type == "cpu" for v in params.values())
    assert all(torch.isfinite(v).all() for v in params.values())   # and hands back CPU tensors


def test_docstring_runbook_names_the_commands():
    doc = T.__doc__
    assert "python -m labkit.torchrun.train" in doc and "--max-restarts=2" in doc
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in doc and "--rdzv-backend=c10d" in doc
    assert os.path.basename(T.__file__) == "train.py"
