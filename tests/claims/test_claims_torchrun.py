"""Claim tests: what torchrun (torch 2.13.0) does, under real ``python -m torch.distributed.run``.

What the launcher sets and does not do, which store ``MASTER_PORT`` points at across restarts,
and how elastic membership changes use ``--max-restarts``. Each docstring quotes the sentence it
backs. Sources in torch: ``distributed/elastic/rendezvous/dynamic_rendezvous.py``
(``next_rendezvous``), ``distributed/elastic/agent/server/local_elastic_agent.py`` (the worker
environment) and ``distributed/elastic/agent/server/api.py`` (``_invoke_run``).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import _claims

pytestmark = pytest.mark.timeout(240)

WORKER = textwrap.dedent("""
    import json, os, socket, sys
    import torch, torch.distributed as dist
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES"]
    seen = {k: os.environ.get(k) for k in keys}
    seen["initialized"] = dist.is_initialized()           # before this script does anything
    if seen["RANK"] == "0":                               # is a store listening already?
        try:
            socket.create_connection((seen["MASTER_ADDR"], int(seen["MASTER_PORT"])), 2).close()
            seen["store_up_before_init"] = True
        except OSError:
            seen["store_up_before_init"] = False
    if seen["TORCHELASTIC_USE_AGENT_STORE"] == "False":
        # rank 0 creates the store here; with the shared store a restarted gloo group often fails
        # to connect on torch 2.13.0 (notebook 05's pitfalls), so that run builds no group
        dist.init_process_group("gloo")
        t = torch.ones(1); dist.all_reduce(t)
        seen["sum"] = t.item()
        dist.destroy_process_group()
    with open(os.path.join(os.environ["SEEN_DIR"], f"{seen['TORCHELASTIC_RESTART_COUNT']}-{seen['RANK']}.json"), "w") as f:
        json.dump(seen, f)
    if seen["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(3)                                       # fail the first attempt
""")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "CUDA_VISIBLE_DEVICES")}
    return {**env, **extra}


def _attempts(tmp_path, **env) -> dict[int, dict[str, dict]]:
    """Run WORKER on 2 workers with one restart; {attempt: {rank: what the worker saw}}."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.2", str(script)]
    done = _claims.run_tree(cmd, timeout=150, env=_clean_env(SEEN_DIR=str(tmp_path), **env))
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]
    out: dict[int, dict[str, dict]] = {}
    for path in tmp_path.glob("*.json"):
        seen = json.loads(path.read_text())
        out.setdefault(int(seen["TORCHELASTIC_RESTART_COUNT"]), {})[seen["RANK"]] = seen
    assert sorted(out) == [0, 1] and all(sorted(a) == ["0", "1"] for a in out.values()), out
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return _attempts(tmp_path_factory.mktemp("shared"))


@pytest.fixture(scope="module")
def unshared(tmp_path_factory):
    return _attempts(tmp_path_factory.mktemp("unshared"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def test_torchrun_sets_the_environment_and_the_script_initialises(shared, unshared):
    """05 "From `mp.spawn` to torchrun: the diff": “torchrun only starts the processes
    and sets the environment variables that `init_process_group` reads; the script calls
    `init_process_group` itself”. 05 "Build it: the lines that make a script a torchrun script":
    “`dist.init_process_group("gloo")`, which, given no rank, size or address, reads `RANK`,
    `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` itself” (the worker calls it so, and the
    all-reduce of its group sums both workers' ones). And 00 "2 · Hello, all-reduce": “torchrun only starts the
    processes and sets the environment variables that `init_process_group` reads; the script
    calls `init_process_group` itself”."""
    for attempt in list(shared.values()) + list(unshared.values()):
        for rank, seen in attempt.items():
            assert seen["initialized"] is False
            assert seen["RANK"] == seen["LOCAL_RANK"] == rank and seen["WORLD_SIZE"] == "2"
            assert seen["MASTER_ADDR"] and seen["MASTER_PORT"]
    for attempt in unshared.values():                   # ... and init_process_group works
        assert [seen["sum"] for seen in attempt.values()] == [2.0, 2.0]


def test_torchrun_sets_omp_threads_and_nccl_error_handling(shared):
    """05 "From `mp.spawn` to torchrun: the diff": “1 when `--nproc-per-node` is more
    than 1 and you did not set it” and “torchrun sets `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` in its
    workers unless you set it”."""
    for attempt in shared.values():
        for seen in attempt.values():
            assert seen["OMP_NUM_THREADS"] == "1"
            assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
            # quiz 05.local_rank's explanation: torchrun does not set CUDA_VISIBLE_DEVICES
            assert seen["CUDA_VISIBLE_DEVICES"] is None


def test_the_shared_store_keeps_master_port_across_restarts(shared):
    """05 "An exception, then a SIGKILL: the whole log": “By default (torch 2.13.0) the workers of every attempt
    share one TCPStore, hosted by the agent that became node 0 at the first rendezvous, so
    `MASTER_PORT` stays the same across restarts”."""
    ports = {seen["MASTER_PORT"] for attempt in shared.values() for seen in attempt.values()}
    assert len(ports) == 1
    for attempt in shared.values():
        assert attempt["0"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert attempt["0"]["store_up_before_init"] is True      # the agent's store, not rank 0's


def test_without_the_shared_store_every_attempt_gets_a_new_port(unshared):
    """05 "An exception, then a SIGKILL: the whole log": “With `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, which this
    lab sets, every attempt gets a new free port and rank 0's worker hosts the store”. 05 "Launch
    it, kill it, watch it resume" (the lab's jobs run with it): “both workers joining again on a
    new `MASTER_PORT`”."""
    ports = [unshared[a]["0"]["MASTER_PORT"] for a in (0, 1)]
    assert ports[0] != ports[1]
    for attempt in unshared.values():
        assert {s["MASTER_PORT"] for s in attempt.values()} == {attempt["0"]["MASTER_PORT"]}
        assert attempt["0"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert attempt["0"]["store_up_before_init"] is False     # rank 0 creates it in init


# ------------------------------------------------------------------ elastic membership
ELASTIC_WORKER = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    world, count = int(os.environ["WORLD_SIZE"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"WORKER world={world} restart_count={count}", flush=True)
    if sys.argv[1] == "join":
        time.sleep(1 if world == 2 else 40)     # alone: wait for the second node to join
        sys.exit(0 if world == 2 else 5)
    dist.init_process_group("gloo")
    t, end = torch.ones(1), time.time() + (3 if world == 1 else 40)
    while time.time() < end:                    # train until the other node is lost
        dist.all_reduce(t); time.sleep(0.05)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:                             # workers run in their own sessions: kill each
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def _agent(tmp_path, port, mode, name, last_call):
    script = tmp_path / "elastic_worker.py"
    script.write_text(ELASTIC_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=claims-elastic", "--local-addr=127.0.0.1", "--monitor-interval=0.2",
           f"--rdzv-conf=last_call_timeout={last_call}", str(script), mode]
    log = open(tmp_path / f"{name}.log", "w")
    env = _clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def _workers(tmp_path, name) -> list[str]:
    return [l.split("WORKER ", 1)[1].strip() for l in (tmp_path / f"{name}.log").read_text()
            .splitlines() if "WORKER " in l]


def _wait(cond, seconds, what):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:   # a wait for an event, not a claim about speed
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_elastic_join_does_not_use_a_restart_but_a_lost_node_does(tmp_path):
    """05 "Multi-node semantics on one machine": “A node joining restarts the workers without
    using up `--max-restarts`; a node that is lost makes the surviving workers fail, and that
    restart counts”. Two agents on loopback, both with `--max-restarts=0`."""
    agents = []
    try:
        # a node joins: node A runs alone (world 1), node B arrives, A restarts with world 2
        port = _free_port()
        a = _agent(tmp_path, port, "join", "join_a", last_call=1)
        agents.append(a)
        _wait(lambda: _workers(tmp_path, "join_a"), 60, "node A's first worker")
        b = _agent(tmp_path, port, "join", "join_b", last_call=1)
        agents.append(b)
        assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
        assert _workers(tmp_path, "join_a") == ["world=1 restart_count=0",
                                                "world=2 restart_count=0"]
        assert _workers(tmp_path, "join_b") == ["world=2 restart_count=0"]

        # a node is lost: with no restart left, the survivor's job fails
        port = _free_port()
        a = _agent(tmp_path, port, "leave", "leave_a", last_call=5)
        agents.append(a)
        _wait(lambda: _listening(port), 30, "node A's rendezvous store")
        b = _agent(tmp_path, port, "leave", "leave_b", last_call=5)
        agents.append(b)
        _wait(lambda: _workers(tmp_path, "leave_a") and _workers(tmp_path, "leave_b"), 60,
              "both workers")
        time.sleep(1)
        _kill_tree(b)                           # node B dies: agent and worker
        assert a.wait(timeout=60) != 0
        assert _workers(tmp_path, "leave_a") == ["world=2 restart_count=0"]
        log = (tmp_path / "leave_a.log").read_text()           # the survivor's worker failed:
        assert re.search(r"Connection (closed|reset) by peer", log), log[-2000:]
    finally:
        for p in agents:
            if p.poll() is None:
                _kill_tree(p)


CUT_SHORT = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "0":
        open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").close()   # a write the SIGTERM cuts short
        time.sleep(60)                                            # until the agent stops the group
    time.sleep(1)
    sys.exit(1)                                                   # rank 1 fails: the group stops
""")


@pytest.mark.timeout(120)
def test_an_error_file_cut_short_crashes_the_agent(tmp_path):
    """README "The project": “on torch 2.13.0 a worker error file cut short by the
    agent's SIGTERM crashes the agent itself instead of restarting the group”. Rank 0 leaves its
    error file empty and waits; rank 1 fails; the agent SIGTERMs rank 0, reads its file again
    and dies of the JSONDecodeError, with a restart still left."""
    script = tmp_path / "cut_short.py"
    script.write_text(CUT_SHORT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.2", str(script)]
    done = _claims.run_tree(cmd, timeout=100, env=_clean_env())
    assert done.returncode != 0
    assert "Failed to parse reply file" in done.stderr, done.stderr[-3000:]
    assert "json.decoder.JSONDecodeError" in done.stderr
    assert "will restart worker group" not in done.stderr        # the restart never happened


def test_a_cut_snapshot_fails_torch_load_without_naming_the_cause(tmp_path):
    """05 "Snapshots that survive a bad disk": “On torch 2.13.0, `torch.load` of a cut file
    raises `RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central
    directory` (what a real checkpoint gives) or, when what is left is between about 4 KiB and
    64 KiB (this lab's small snapshot), `OSError: [Errno 22] Invalid argument`; neither names
    the cause.”"""
    import torch

    whole = tmp_path / "snapshot.pt"
    torch.save({"model": torch.arange(200_000.0), "step": 16}, whole)     # 800 KB
    data = whole.read_bytes()
    seen = {}
    for cut in (1000, 30_000, 60_000, 100_000, len(data) // 2, len(data) - 16):
        part = tmp_path / f"cut{cut}.pt"
        part.write_bytes(data[:cut])
        with pytest.raises((RuntimeError, OSError)) as err:
            torch.load(part)
        seen[cut] = f"{type(err.value).__name__}: {err.value}"
    central = ("RuntimeError: PytorchStreamReader failed reading zip archive: "
               "failed finding central directory")
    assert all(seen[c].startswith(central) for c in (1000, 100_000, len(data) // 2,
                                                     len(data) - 16)), seen
    assert seen[30_000] == seen[60_000] == "OSError: [Errno 22] Invalid argument", seen

def test_max_restarts_defaults_to_zero():
    """05 "The concept: agents, workers, rendezvous, restarts": “the flag defaults to 0, so by
    default the first failure ends the job”. torchrun's own argument parser, without the flag."""
    from torch.distributed.run import get_args_parser, parse_args
    assert get_args_parser().parse_args(["train.py"]).max_restarts == 0
    assert parse_args(["--nproc-per-node=8", "train.py"]).max_restarts == 0


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
