"""Capstone pieces without processes: data order, padding, checkpoint rotation and verification, the script."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from capstone_common import TINY
from labkit.portable import checkpoints as C
from labkit.capstone import data as D
from labkit.capstone import evaluate as E
from labkit.capstone import model as M
from labkit.capstone import train_gpt as G

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------ data
def test_corpus_is_the_stdlib_read_in_a_fixed_order():
    a, b = D.load_corpus(50_000), D.load_corpus(50_000)
    assert a.files == b.files and a.fingerprint == b.fingerprint and torch.equal(a.train, b.train)
    assert list(a.files) == sorted(a.files) and not any(f.startswith("_") for f in a.files)
    assert len(a.train) + len(a.val) == 50_000 and len(a.val) == 5_000
    first = (Path(a.root) / a.files[0]).read_bytes()
    assert D.decode(a.train[:200]) == first[:200].decode()
    assert D.load_corpus(40_000).fingerprint != a.fingerprint


def test_a_folder_without_sources_is_refused_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--corpus-dir"):
        D.load_corpus(root=str(tmp_path))


def test_windows_are_shifted_pairs():
    w = D.Windows(torch.arange(100), 8)
    assert len(w) == 12
    x, y = w[11]
    assert x.tolist() == list(range(88, 96)) and y.tolist() == list(range(89, 97))
    with pytest.raises(IndexError):
        w[12]
    with pytest.raises(ValueError, match="--block-size"):
        D.Windows(torch.arange(5), 8)


def _global_batches(world_size: int, accum: int, steps: int, start: int = 0) -> list[list]:
    data = D.Windows(torch.arange(400), 4)       # 99 windows, 12 steps of 8 per epoch
    its = [D.rank_batches(data, 8, accum, r, world_size, seed=3, start_step=start)
           for r in range(world_size)]
    out = []
    for _ in range(steps):
        rows = [row for it in its for x, _ in next(it) for row in x.tolist()]
        out.append(sorted(rows))
    return out


@pytest.mark.parametrize("world_size, accum", [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_a_step_sees_the_same_windows_on_any_world_size(world_size, accum):
    """The data position is the step: the set of windows per step does not depend on the ranks."""
    one = _global_batches(1, 1, 30)                          # crosses two epoch boundaries
    assert _global_batches(world_size, accum, 30) == one
    assert _global_batches(world_size, accum, 10, start=20) == one[20:]   # resumed at step 20
    assert one[0] != one[12]                                 # a new epoch, a new order


def test_batch_sizes_that_do_not_split_are_refused():
    data = D.Windows(torch.arange(400), 4)
    with pytest.raises(ValueError, match="multiple of 6"):
        next(D.rank_batches(data, 8, 2, 0, 3, seed=0))


# ------------------------------------------------------------------- evaluation padding
@pytest.mark.parametrize("n, world_size", [(9, 2), (9, 4), (10, 3), (8, 4), (3, 4)])
def test_padding_is_marked_so_each_window_counts_once(n, world_size):
    counted = []
    for r in range(world_size):
        idx, real = E.rank_windows(n, r, world_size)
        assert len(idx) == -(-n // world_size)               # every rank: the same count
        counted += [i for i, keep in zip(idx, real) if keep]
    assert sorted(counted) == list(range(n))


# --------------------------------------------------------------------------- model
def test_gpt_init_is_seeded_and_leaves_the_global_rng_alone():
    cfg = M.GPTConfig(block_size=8, n_layer=1, n_embd=16, n_head=2)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a, b = M.make_gpt(cfg), M.make_gpt(cfg)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.head.weight, M.make_gpt(cfg, seed=1).head.weight)
    with pytest.raises(ValueError, match="block_size is 8"):
        a(torch.zeros(1, 9, dtype=torch.long))


def test_initial_loss_is_that_of_a_uniform_guess():
    m = M.make_gpt(M.GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)).eval()
    x = torch.randint(256, (4, 16), generator=torch.Generator().manual_seed(0))
    _, loss = m(x, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


# --------------------------------------------------------------------- checkpoints
def _save(ckpts: C.Checkpoints, step: int, payload: bytes = b"weights") -> Path:
    with ckpts.writing(step, meta={"step": step}) as folder:
        (folder / "shard0.bin").write_bytes(payload * 100)
        (folder / ".metadata").write_bytes(b"meta")
    return ckpts.folder(step)


def test_commit_writes_sizes_and_checksums_last(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=2)
    path = _save(ckpts, 8)
    manifest = json.loads((path / C.MANIFEST).read_text())
    assert manifest["files"]["shard0.bin"]["bytes"] == 700 and manifest["meta"] == {"step": 8}
    assert len(manifest["files"]["shard0.bin"]["sha256"]) == 64
    assert C.problems(path) == [] and ckpts.latest().step == 8


def test_a_save_that_raises_leaves_no_manifest_and_is_skipped(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=2, log=(logged := []).append)
    _save(ckpts, 8)
    with pytest.raises(OSError, match="disk full"):
        with ckpts.writing(16) as folder:
            (folder / "shard0.bin").write_bytes(b"half")
            raise OSError("disk full")
    assert ckpts.latest().step == 8
    assert "step_00000016/MANIFEST.json: missing (the save did not finish" in logged[0]


def test_only_the_newest_k_are_kept(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=3)
    (tmp_path / "step_00000002").mkdir()                    # an unfinished save, older
    for step in (4, 8, 12, 16, 20):
        _save(ckpts, step)
    assert [s for s, _ in ckpts.folders()] == [12, 16, 20]
    with pytest.raises(ValueError, match="keep at least 1"):
        C.Checkpoints(tmp_path, keep=0)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _zero_fill(p: Path) -> None:
    p.write_bytes(bytes(p.stat().st_size))


def _delete(p: Path) -> None:
    p.unlink()


def _garble(p: Path) -> None:
    p.write_text("{not json")


DAMAGE = {"truncate": (_truncate, "truncated"), "zero-fill": (_zero_fill, "checksum mismatch"),
          "delete": (_delete, "missing (deleted")}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("victim", ["shard0.bin", ".metadata"])
def test_a_damaged_newest_checkpoint_falls_back_naming_the_file(tmp_path, damage, victim):
    ckpts = C.Checkpoints(tmp_path, keep=2, log=(logged := []).append)
    _save(ckpts, 8)
    newest = _save(ckpts, 16)
    fn, words = DAMAGE[damage]
    fn(newest / victim)
    found = ckpts.latest()
    assert found.step == 8
    assert len(logged) == 1 and str(newest / victim) in logged[0] and words in logged[0]
    assert "Falling back" in logged[0]


def test_a_garbled_manifest_is_named(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=2, log=(logged := []).append)
    _save(ckpts, 8)
    _garble(_save(ckpts, 16) / C.MANIFEST)
    assert ckpts.latest().step == 8 and "MANIFEST.json: unreadable" in logged[0]


def test_no_valid_checkpoint_names_every_file(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=2, log=lambda m: None)
    old, new = _save(ckpts, 8), _save(ckpts, 16)
    _zero_fill(old / "shard0.bin")
    _delete(new / ".metadata")
    with pytest.raises(C.NoValidCheckpoint) as err:
        ckpts.latest()
    msg = str(err.value)
    assert str(old / "shard0.bin") in msg and str(new / ".metadata") in msg
    assert "all 2 are damaged" in msg and "start the run from step 0" in msg
    assert set(err.value.damaged) == {str(old), str(new)}


def test_no_checkpoints_at_all_is_a_fresh_start(tmp_path):
    assert C.Checkpoints(tmp_path / "nothing").latest() is None


def test_a_new_save_replaces_a_half_written_folder_of_the_same_step(tmp_path):
    ckpts = C.Checkpoints(tmp_path, keep=2)
    stale = ckpts.folder(8)
    stale.mkdir(parents=True)
    (stale / "__1_0.distcp").write_bytes(b"from a crashed attempt")
    _save(ckpts, 8)
    assert sorted(p.name for p in stale.iterdir()) == [".metadata", C.MANIFEST, "shard0.bin"]


# -------------------------------------------------------------------------- script
def test_lr_warms_up_then_decays_to_min_lr():
    cfg = G.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1e-3", "--min-lr", "1e-4"])
    lrs = [G.lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_a_checkpoint_of_another_run_is_refused():
    cfg = G.parse_args(TINY)
    meta = {"config": {k: getattr(cfg, k) for k in G.SAME}, "corpus": "abc"}
    G._check_resumable(meta, cfg, "abc", "here")
    with pytest.raises(ValueError, match="made with --batch-size 8, this run has --batch-size 16"):
        G._check_resumable(meta, G.parse_args(TINY + ["--batch-size", "16"]), "abc", "here")
    with pytest.raises(ValueError, match="trained on other text"):
        G._check_resumable(meta, cfg, "xyz", "here")


def _imports(path: Path) -> set[tuple[int, str]]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {(0, a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add((node.level, node.module or ""))
    return out


def test_the_script_is_a_leaf_torch_and_its_siblings_only():
    """Learners copy labkit/capstone/ anywhere: it must not need the lab's runtime (lk.run). It
    imports torch, its siblings and labkit/portable/ (plain Python that imports nothing of the lab:
    tests/portable/test_portable.py)."""
    folder = Path(G.__file__).parent
    siblings = {p.stem for p in folder.glob("*.py")}
    # notebook 08's readers and grader (see the package docstring): the lab's, not the project
    lab_side = {"runs.py"}                     # and check/, a folder
    for path in sorted(p for p in folder.glob("*.py") if p.name not in lab_side):
        for level, name in _imports(path):
            top = name.split(".")[0]
            if level == 2:
                assert name.startswith("portable."), f"{path.name}: from ..{name}"
            elif level:
                assert level == 1 and top in siblings | {""}, f"{path.name}: from {'.' * level}{name}"
            else:
                assert top == "torch" or top in sys.stdlib_module_names, f"{path.name}: {name}"


def test_the_distributed_delta_is_small_and_tagged():
    src = Path(G.__file__).read_text().splitlines()
    tagged = [ln for ln in src if ln.rstrip().endswith("# [dist]")]
    assert 20 <= len(tagged) <= 40
    for needle in ("DDP(model", "fully_shard(", "init_device_mesh(", "no_sync()",
                   "set_requires_gradient_sync(", "init_process_group(", "destroy_process_group()",
                   "all_reduce(", "broadcast_object_list("):
        assert any(needle in ln for ln in tagged), needle


def test_the_runbook_docstring_has_the_commands():
    doc = G.__doc__
    for needle in ("python -m labkit.capstone.train_gpt", "--max-restarts=2", "--parallel fsdp",
                   "--nnodes=1:2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "--crash-at-step"):
        assert needle in doc, needle


@pytest.mark.parametrize("module", [D, M, E, C])
def test_docstring_examples_run(module):
    import doctest

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
