"""The runner inside a real Jupyter kernel: interrupt, restart, shutdown leave no rank behind."""
from __future__ import annotations

import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(180)

HANG = """
import labkit as lk, time
def spin(rank, world_size):
    import torch, torch.distributed as dist
    if rank == 0:
        time.sleep(120)
    dist.all_reduce(torch.ones(1))
lk.run(spin, world_size=3, timeout=120)
"""


def _execute(kc, code: str, timeout: float = 60) -> list[dict]:
    msg_id = kc.execute(code)
    outputs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] in ("stream", "error", "execute_result"):
            outputs.append(msg["content"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return outputs


def _lab_pids(kernel_pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(kernel_pid).children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


def _ranks(kernel_pid: int) -> list[int]:
    return [c.pid for z in psutil.Process(kernel_pid).children() for c in z.children()
            if c.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_interrupting_a_job_kills_its_ranks_and_the_next_job_works(kernel):
    km, kc = kernel
    pid = km.provisioner.process.pid
    msg_id = kc.execute(HANG)
    end = time.monotonic() + 60
    while len(_ranks(pid)) < 3 and time.monotonic() < end:  # wait until the job is running
        time.sleep(0.1)
    assert len(_ranks(pid)) == 3
    km.interrupt_kernel()
    errors = []
    while True:  # until the interrupted cell is over (a request sent earlier would be aborted)
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            errors.append(msg["content"]["ename"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert errors == ["KeyboardInterrupt"]
    end = time.monotonic() + 5
    while _ranks(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert _ranks(pid) == []
    out = _execute(kc, "print(lk.run(lambda r, w: r * 10, world_size=3, echo=False).values)")
    assert any("[0, 10, 20]" in o.get("text", "") for o in out), out


def test_shutting_down_the_kernel_ends_every_lab_process(kernel):
    km, kc = kernel
    pid = km.provisioner.process.pid
    _execute(kc, "import labkit as lk\nlk.run(lambda r, w: r, world_size=2, echo=False)")
    children = _lab_pids(pid)
    assert len(children) == 3  # the launcher and 2 warm ranks
    km.shutdown_kernel(now=False)
    end = time.monotonic() + 15
    while any(psutil.pid_exists(p) for p in children) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in children if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
