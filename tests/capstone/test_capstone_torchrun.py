"""The capstone under real torchrun (gloo): crash and SIGKILL -> restart -> bit for bit; a node leaves.

Each job is small (tiny GPT, 1 thread per worker) and every test ends with no
process of any torchrun job left alive.
"""
from __future__ import annotations

import psutil
import pytest
import torch

from capstone_common import (TINY, equal, losses, no_ranks_at_the_end,
                             on_ranks)
from labkit.capstone import train_gpt as G
from labkit.runtime.torchrun import TorchrunTimeout, launch
from labkit.torchrun import runs
from labkit.torchrun.train import parse_log

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow,
              pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]

SCRIPT = "labkit.capstone.train_gpt"
ARGV = TINY + ["--steps", "16"]


def _reached(step: int, attempt: int | None = None):
    """A predicate for job.follow: rank 0 logged ``step`` (on ``attempt``, if given)."""
    return lambda ln: any(s >= step and (attempt is None or a == attempt)
                          for s, _, a in parse_log([ln.text]))


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run on 2 warm lab ranks: what every restarted torchrun run must equal."""
    res = on_ranks(ARGV + ["--out-dir", ""])
    return res.values[0], losses(res.stdout[0])


def test_crash_then_sigkill_restart_and_resume_bit_for_bit(tmp_path, reference):
    """Attempt 0: rank 1 raises at step 6. Attempt 1: we SIGKILL rank 0 at step 10. Attempt 2 ends."""
    job = launch(SCRIPT, ARGV + ["--out-dir", str(tmp_path), "--crash-rank", "1",
                                 "--crash-at-step", "6", "--step-delay", "0.1"],
                 nproc_per_node=2, max_restarts=2, echo=False)
    assert job.follow(until=_reached(10, attempt=1), timeout=120) is not None, job.wait().tail()
    assert job.workers()[0].environ()["TORCHELASTIC_RESTART_COUNT"] == "1"
    job.kill(0)
    result = job.wait(120)
    assert result.ok, result.tail(30)
    assert (result.attempts, result.restarts) == (3, 2)
    assert runs.resumes(result) == [4, 8]                       # the newest checkpoint each time
    assert result.failures[0]["exitcode"] == 1            # the injected fault
    assert "InjectedFault: injected fault: rank 1 crashes at step 6" in "\n".join(
        result.rank_lines(1))
    ref_params, ref_losses = reference
    seen = {}
    for step, loss, attempt in runs.losses(result):             # a re-run step logs the loss it had
        assert seen.setdefault(step, loss) == loss == ref_losses[step], (step, attempt)
    assert sorted(seen) == list(range(1, 17)) and {a for _, _, a in runs.losses(result)} == {0, 1, 2}
    assert equal(torch.load(tmp_path / G.FINAL), ref_params)
    assert "done: 16 steps on 2 rank(s)" in "\n".join(result.rank_lines(0))


def _rendezvous_host(job) -> int:
    """Which agent serves the c10d rendezvous store (the first to bind the port wins)."""
    endpoint = next(a for a in job.cmds[0] if a.startswith("--rdzv-endpoint="))
    port = int(endpoint.rsplit(":", 1)[1])
    for i, agent in enumerate(job.agents):
        for conn in psutil.Process(agent.pid).net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                return i
    raise AssertionError("no agent listens on the rendezvous port")


def test_elastic_job_goes_on_when_a_node_leaves(tmp_path):
    """--nnodes=1:2, two agents on loopback; the node that does not host the rendezvous dies."""
    conf = "--rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    job = launch(SCRIPT, ARGV + ["--out-dir", str(tmp_path), "--step-delay", "0.2"],
                 nproc_per_node=1, nnodes="1:2", max_restarts=2, echo=False, extra=[conf])
    assert job.follow(until=_reached(9), timeout=120) is not None, job.wait().tail()
    leaving = 1 - _rendezvous_host(job)
    agent = psutil.Process(job.agents[leaving].pid)
    for p in [agent, *agent.children(recursive=True)]:   # the whole node, at once
        p.kill()
    try:
        result = job.wait(120)
    except TorchrunTimeout:                      # the whole story, not the last 8 lines
        pytest.fail("the job did not finish:\n" + "\n".join(ln.format() for ln in job.lines))
    assert result.returncodes[1 - leaving] == 0 and result.returncodes[leaving] == -9, \
        result.tail(30)
    out = "\n".join(result.rank_lines(0))
    assert "saved by 2 rank(s) (ddp), now 1 (ddp)" in out and "resharded 2 -> 1 ranks" in out
    assert runs.resumes(result) == [8] and "done: 16 steps on 1 rank(s)" in out
    assert sorted({s for s, _, _ in runs.losses(result)}) == list(range(1, 17))


@pytest.mark.parametrize("nnodes", [0, "2:1", "x", ":2", "0:0"])
def test_launch_refuses_a_bad_nnodes_before_starting_anything(nnodes):
    from labkit.runtime.torchrun import TorchrunError, live_processes

    with pytest.raises(TorchrunError, match="MIN:MAX"):
        launch(SCRIPT, nnodes=nnodes, echo=False)
    assert live_processes() == []
