"""NCCL log capture (notebook 04 §9): the plumbing on gloo here, the NCCL logs on GPU machines."""
from __future__ import annotations

import subprocess
import sys

import pytest

import labkit as lk
from conftest import has_gpus, needs_gpus
from labkit.pitfalls import nccl_capture as C
from labkit.pitfalls import nccl_faults
from labkit.runtime.torchrun import live_processes

pytestmark = pytest.mark.timeout(240)


def test_gloo_capture_records_the_job_and_reads_back(tmp_path, capsys):
    path = C.capture("skipped", tmp_path, backend="gloo", timeout=3.0)
    assert live_processes() == []
    (cap,) = C.stored(tmp_path)
    assert cap.path == path
    h = cap.header
    assert (h["scenario"], h["backend"], h["gpus"]) == ("skipped", "gloo", "none")
    assert h["torch"].startswith("2.") and h["exit"] != "[0]"
    assert "nccl_faults skipped --timeout 3.0 --backend gloo" in h["command"]
    issued = [ln for ln in cap.text.splitlines() if "issued" in ln]
    assert any("rank 1: all_reduce #2 issued" in ln for ln in issued)
    assert not any("rank 1: all_reduce #3" in ln for ln in issued)   # the skipped one
    assert "RuntimeError" in cap.excerpt() and "(none was written)" in cap.excerpt()
    C.show(tmp_path)
    out = capsys.readouterr().out
    assert "CAPTURED LOG, not a live run: skipped" in out and "backend: gloo" in out


def test_live_streams_the_run_and_prints_its_dumps(capsys):
    (cap,) = C.live(["skipped"], backend="gloo", timeout=3.0)
    out = capsys.readouterr().out
    assert "LIVE run on this machine: skipped (gloo)" in out
    assert "rank 1: all_reduce #2 issued" in out and "RuntimeError" in out   # streamed
    assert "torchrun exit codes [1]" in out and "flight-recorder dumps (0)" in out
    assert cap.header["backend"] == "gloo" and not cap.path.exists()      # temp file removed
    assert live_processes() == []


def _fr_dump(rank, world_size):
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    return c10d._dump_fr_trace()


def test_flight_summary_reads_a_real_dump(tmp_path):
    dump = lk.run(_fr_dump, 2, backend="gloo", env={"TORCH_FR_BUFFER_SIZE": "16"}).values[0]
    (tmp_path / "rank_0").write_bytes(dump)
    text = C._flight_summary(str(tmp_path / "rank_0"))
    lines = text.splitlines()
    assert lines[0].startswith("rank_0: version") and "entries" in lines[0]
    ops = [ln for ln in lines if ln.lstrip().startswith("seq")]
    assert len(ops) == 2 and "all_reduce" in ops[0] and "broadcast" in ops[1], text
    assert all(" state " in op for op in ops), text    # gloo leaves them "scheduled"
    assert "'last_enqueued_collective': 2" in text, text


@pytest.mark.skipif(has_gpus(1), reason="checks the refusal on a machine without GPUs")
def test_without_gpus_the_tool_refuses_clearly(tmp_path):
    p = subprocess.run([sys.executable, "-m", "labkit", "nccl-capture", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr and "GPU machine" in p.stderr
    with pytest.raises(C.CaptureError, match="busy_gpu needs 1 CUDA GPU"):
        C.capture("busy_gpu", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(C.CaptureError, match="no scenario 'hang'"):
        C.capture("hang", tmp_path)
    with pytest.raises(SystemExit) as e:       # the script: GPU scenarios need NCCL
        nccl_faults.main(["busy_gpu", "--backend", "gloo"])
    assert e.value.code == 2


def test_stored_rejects_files_that_are_not_captures(tmp_path, capsys):
    C.show(tmp_path)
    assert "No NCCL capture is stored" in capsys.readouterr().out
    (tmp_path / "watchdog.log").write_text("[rank0]: Watchdog caught collective operation timeout\n")
    with pytest.raises(C.CaptureError, match="watchdog.log is not a labkit capture"):
        C.stored(tmp_path)


def test_the_stored_captures_are_nccl_runs():
    for cap in C.stored():          # what notebook 04 shows: each one a real NCCL run
        assert cap.header["backend"] == "nccl" and cap.header["gpus"] != "none", cap.path
        assert "NCCL INFO" in cap.text, cap.path


@pytest.mark.gpu
@needs_gpus(1)
def test_nccl_captures_on_one_gpu(tmp_path):
    text = C.load(C.capture("busy_gpu", tmp_path, timeout=5.0)).text
    assert "NCCL INFO" in text and "Watchdog caught collective operation timeout" in text
    assert "rank_0: version" in text                      # the dump on the timeout
    same = C.capture("same_device", tmp_path).read_text()
    assert "Duplicate GPU" in same
    assert live_processes() == []


@pytest.mark.gpu
@needs_gpus(2)
def test_nccl_capture_of_the_skipped_collective(tmp_path):
    text = C.capture("skipped", tmp_path, timeout=5.0).read_text()
    assert "Watchdog caught collective operation timeout" in text and "OpType=ALLREDUCE" in text
    assert "rank_0: version" in text
