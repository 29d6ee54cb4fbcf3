"""The checker of notebook 05's core build, ``05.torchrun_lines``: the lines of a torchrun script.

The build is ``torchrun_main(body, *args)``: read ``RANK`` and ``WORLD_SIZE`` from the
environment torchrun sets, join the process group from that environment
(``dist.init_process_group("gloo")``), run ``body(rank, world_size, *args)``, leave the group.
:func:`check_torchrun_lines` launches it twice, at once, under real torchrun
(:func:`labkit.torchrun.entry.launch_call`), with the checker's own body (a probe):

* **A** — ``--standalone --nproc-per-node=2 --max-restarts=1``: the probe of worker ``RANK=1``
  raises on the first attempt, after proving it joined, so torchrun stops the group and starts
  it again (a new ``MASTER_PORT``: the lab sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
* **B** — three agents on loopback, ``--nnodes=3 --nproc-per-node=1`` (three nodes on one
  machine, as in the notebook's "Multi-node semantics" deep dive): ``WORLD_SIZE`` is 3,
  ``LOCAL_WORLD_SIZE`` 1, and every worker has ``LOCAL_RANK=0`` whatever its ``RANK``, so
  ``LOCAL_RANK`` read for ``RANK``, and a world size of 2 written in (or
  ``LOCAL_WORLD_SIZE`` read for it), are caught and told apart.

In each worker the probe records the ``rank`` and ``world_size`` it was given, and proves the
membership: it gathers ``(RANK, pid, a secret drawn now)`` from every worker with
``dist.all_gather_object``, which only a real group delivers, and reads gloo's flight
recorder (:mod:`labkit.grading.watch`): an all-gather that arrived without gloo running one
went through a side channel (a file, the store) behind a faked ``torch.distributed``. Around
the learner's function the harness (:func:`_harness`) records every
``init_process_group`` call (and stops one that could only hang or join another job: a rank,
world size, address or store of its own), whether a group is left when it returns, and whether
the lab's own ``torchrun_main`` (:func:`labkit.grading.references.reference`) ran. Cases that
an answer passes idly when no worker joined count for nothing.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path

from ...grading.exercise import case
from ...runtime.torchrun import TorchrunTimeout

__all__ = ["check_torchrun_lines", "grade", "LIMIT_S", "INIT_TIMEOUT_S"]

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
       "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
LIMIT_S = 150.0        # one launch: ~25 s alone on 2 cores, both at once, several times that busy
INIT_TIMEOUT_S = 30    # init_process_group's timeout when the answer gives none: a join that
                       # waits for workers that will never come fails in 30 s, not 30 min
OUTLIVE_S = 30.0       # how long worker RANK=0 waits for the others' probes (it hosts the store)
CRASH_RANK = 1         # run A: the worker whose probe fails on the first attempt
JOB_ENV = {"CUDA_VISIBLE_DEVICES": "", "TORCH_FR_BUFFER_SIZE": "2000"}
RUNS = {"A": {"nproc_per_node": 2, "max_restarts": 1, "nnodes": 1},
        "B": {"nproc_per_node": 1, "max_restarts": 0, "nnodes": 3}}


class Rejected(RuntimeError):
    """The checker stopped an ``init_process_group`` call that ignores torchrun's environment."""


class InjectedFault(RuntimeError):
    """The checker's fault: worker ``RANK=1`` of run A fails on the first attempt."""


# ------------------------------------------------------------------ in each torchrun worker
def _plain(value):
    return value if isinstance(value, (int, str, type(None))) and not isinstance(value, bool) \
        else repr(value)


def _init_call(real, args, kwargs) -> dict:
    """What an ``init_process_group`` call asked for, its arguments bound by name."""
    import inspect

    bound = inspect.signature(real).bind_partial(*args, **kwargs).arguments
    store = bound.get("store")
    return {"backend": _plain(bound.get("backend")), "init_method": _plain(bound.get("init_method")),
            "rank": _plain(bound.get("rank", -1)), "world_size": _plain(bound.get("world_size", -1)),
            "store": None if store is None else type(store).__name__,
            "timeout": "timeout" in bound and bound["timeout"] is not None,
            "env": {k: os.environ.get(k) for k in ENV}}


def _init_problem(call: dict, env: dict) -> str | None:
    """Why this ``init_process_group`` call does not take the job from torchrun's environment."""
    import socket
    from urllib.parse import urlparse

    who = f"worker RANK={env['RANK']}"
    if call["store"]:
        return (f"{who} called init_process_group(store={call['store']}(...)): a store of its "
                f"own, not the one torchrun points every worker at (MASTER_ADDR:MASTER_PORT). "
                f"Give it the backend alone: dist.init_process_group(\"gloo\")")
    method = call["init_method"]
    if method not in (None, "env://"):
        url = urlparse(str(method))
        hosts = {env["MASTER_ADDR"]}
        try:
            hosts.add(socket.gethostbyname(env["MASTER_ADDR"]))
        except OSError:
            pass
        if not (url.scheme == "tcp" and url.hostname in hosts and str(url.port) == env["MASTER_PORT"]):
            return (f"{who} called init_process_group(init_method={method!r}): an address of "
                    f"its own, not torchrun's MASTER_ADDR:MASTER_PORT "
                    f"({env['MASTER_ADDR']}:{env['MASTER_PORT']}, a new port on every attempt); "
                    f"on a cluster that is another job's port, or a file no other node sees. "
                    f"Leave init_method out: init_process_group reads MASTER_ADDR/MASTER_PORT")
    for name, var in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        given = call[name]
        if given not in (-1, None) and str(given) != env[var]:
            return (f"{who} called init_process_group({name}={given}), but torchrun made it "
                    f"{var}={env[var]}: the group would wait for a worker that never comes. "
                    f"Leave {name} out (init_process_group reads {var}), or pass "
                    f"int(os.environ[\"{var}\"])")
    changed = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if call["env"][k] != env[k]]
    if changed:
        k = changed[0]
        return (f"{who}: {k} was {env[k]} from torchrun and {call['env'][k]} when "
                f"init_process_group read it: the script overwrote torchrun's environment")
    return None


def _write(folder: str, name: str, data: dict) -> None:
    tmp = Path(folder) / f"{name}.tmp"
    tmp.write_text(json.dumps(data, default=repr))
    os.replace(tmp, Path(folder) / name)


def _probe(rank, world_size, env: dict, real: dict) -> dict:
    """The checker's body: what it was given, and proof of the group it runs in."""
    import torch.distributed as dist

    from ...grading.watch import last_record_id, recorded

    out = {"rank": _plain(rank), "world_size": _plain(world_size), "initialized": False,
           "torch_group": bool(real["is_initialized"]()), "env": env}
    try:
        joined = bool(dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001  (a faked torch.distributed: whatever it does)
        joined = False
    if not joined:
        return out
    group = [dist.get_rank(), dist.get_world_size()]
    out.update(initialized=True, group=group)
    if group != [int(env["RANK"]), int(env["WORLD_SIZE"])]:
        return out                           # a gather here could only hang: nothing to prove
    me = [env["RANK"], os.getpid(), os.urandom(8).hex()]
    mark = last_record_id()
    got = [None] * group[1]
    dist.all_gather_object(got, me)
    out.update(me=me, gathered=got, collectives=[name for name, _ in recorded(mark)])
    return out


def _wait_for(folder: str, attempt: str, env: dict, kind: str) -> None:
    """Until every worker of this attempt has written its ``kind`` file (``OUTLIVE_S`` at most:
    a worker that died makes the agent stop this one anyway)."""
    want = [Path(folder) / f"a{attempt}_r{r}.{kind}" for r in range(int(env["WORLD_SIZE"]))]
    end = time.monotonic() + OUTLIVE_S
    while time.monotonic() < end and not all(w.exists() for w in want):
        time.sleep(0.02)


def _harness(main, folder: str, crash: bool) -> None:
    """Run in each torchrun worker: the learner's ``main(body)``, watched (see the module)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from ...grading.references import references_used

    env = {k: os.environ.get(k) for k in ENV}
    attempt, me = env["TORCHELASTIC_RESTART_COUNT"] or "0", env["RANK"]
    tag = f"a{attempt}_r{me}"
    report: dict = {"env": env, "inits": [], "error": None, "not_done": False, "body": False,
                    "references": [], "pg_left": None}
    real = {"init": c10d.init_process_group, "is_initialized": c10d.is_initialized,
            "destroy": c10d.destroy_process_group}

    def watched_init(*args, **kwargs):
        call = _init_call(real["init"], args, kwargs)
        call["problem"] = _init_problem(call, env)
        report["inits"].append(call)
        _write(folder, f"{tag}.inits", {"inits": report["inits"]})   # before it can hang
        if call["problem"]:
            raise Rejected(call["problem"])
        if not call["timeout"]:
            from datetime import timedelta
            kwargs["timeout"] = timedelta(seconds=INIT_TIMEOUT_S)
        return real["init"](*args, **kwargs)

    def body(rank, world_size, *rest):
        report["body"] = True
        probe = _probe(rank, world_size, env, real)
        _write(folder, f"{tag}.probe", probe)
        fault = crash and attempt == "0" and me == str(CRASH_RANK)
        if me == "0" or fault:               # rank 0 hosts the store: it leaves last; the fault
            _wait_for(folder, attempt, env, "probe")   # waits for every probe (workers that
        if fault:                                      # joined no group are not in step)
            raise InjectedFault(f"the checker's fault: worker RANK={me} fails on attempt 0")
        return "done"

    dist.init_process_group = c10d.init_process_group = watched_init
    failed = None
    try:
        with references_used("labkit.") as used:
            main(body)
    except InjectedFault as exc:
        failed = exc
    except NotImplementedError:
        report["not_done"] = True
    except BaseException as exc:  # noqa: BLE001  (the learner's error goes back to the checker)
        report["error"] = _error_text(exc)
        failed = exc
    finally:
        dist.init_process_group = c10d.init_process_group = real["init"]
    report["references"] = list(used)
    report["pg_left"] = bool(real["is_initialized"]())
    _write(folder, f"{tag}.json", report)
    if report["pg_left"]:
        if me == "0":                        # a group left behind: rank 0's process still hosts
            _wait_for(folder, attempt, env, "json")   # its store; the others may still use it
        real["destroy"]()
    if failed is not None:
        raise failed                         # the worker fails: torchrun sees it


def _error_text(exc: BaseException) -> str:
    """The exception's last line, and the checker's own reason when it is in the chain."""
    seen, chain = set(), exc
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, Rejected):
            return f"Rejected: {chain}"
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


# ------------------------------------------------------------------ in the checker's process
def _launch(fn, name: str, folder: str):
    from ..entry import launch_call

    spec = RUNS[name]
    return launch_call(_harness, (fn, folder, name == "A"), echo=False, env=JOB_ENV, **spec)


def _reports(folder: str) -> dict:
    """``{(attempt, RANK): {"report": ..., "probe": ..., "inits": [...]}}`` from a run's folder
    (what a worker stopped early did not write is missing)."""
    out: dict = {}
    for kind, suffix in (("report", "json"), ("probe", "probe"), ("inits", "inits")):
        for path in Path(folder).glob(f"a*_r*.{suffix}"):
            key = tuple(int(x[1:]) for x in path.name.split(".")[0].split("_"))
            data = json.loads(path.read_text())
            out.setdefault(key, {})[kind] = data["inits"] if kind == "inits" else data
    return out


def check_torchrun_lines(fn) -> list:
    """Checker for ``05.torchrun_lines``: launch ``fn`` under torchrun (runs A and B, at once)
    and grade every worker of every attempt."""
    code = getattr(fn, "__code__", None)
    if code is not None and "NotImplementedError" in code.co_names:
        raise NotImplementedError(f"{getattr(fn, '__name__', 'the function')} is still the stub")
    with tempfile.TemporaryDirectory(prefix="labkit-lines-") as tmp:
        folders = {name: tempfile.mkdtemp(dir=tmp, prefix=f"{name}-") for name in RUNS}
        jobs = {name: _launch(fn, name, folders[name]) for name in RUNS}
        runs: dict = {}
        for name, job in jobs.items():
            try:
                runs[name] = job.wait(LIMIT_S)
            except TorchrunTimeout as exc:
                runs[name] = "\n".join(ln.format() for ln in exc.last) or "(none)"
        found = {name: _reports(folder) for name, folder in folders.items()}
    if any(r.get("report", {}).get("not_done") for rs in found.values() for r in rs.values()):
        raise NotImplementedError(f"{getattr(fn, '__name__', 'the function')} still raises "
                                  f"NotImplementedError")
    return grade(runs, found)


def _world(name: str) -> int:
    return RUNS[name]["nproc_per_node"] * RUNS[name]["nnodes"]


def _who(env: dict) -> str:
    return f"worker RANK={env['RANK']} (LOCAL_RANK={env['LOCAL_RANK']})"


def grade(runs: dict, found: dict) -> list:
    """The cases, from what the two runs left: ``runs[name]`` is the finished
    :class:`~labkit.runtime.torchrun.Run`, or the last lines of one that timed out;
    ``found[name][(attempt, RANK)]`` holds what the worker wrote: its ``report`` (when its
    entry point returned or raised), its body's ``probe``, its ``inits`` (each
    ``init_process_group`` call, written as it was made)."""
    last_a = max((a for a, _ in found["A"]), default=0)
    attempts = {"A": sorted({0, last_a}), "B": [0]}

    def workers(name: str, attempt: int):
        """Every worker an attempt should have had: (RANK, what it wrote)."""
        return [(r, found[name].get((attempt, r), {})) for r in range(_world(name))]

    def where(name: str, attempt: int) -> str:
        return f"run {name}{' (3 nodes)' if name == 'B' else ''}, attempt {attempt}"

    def missing(name: str, attempt: int, rank: int, wrote: dict) -> str:
        report = wrote.get("report")
        if report and report.get("error"):
            return (f"{where(name, attempt)}: worker RANK={rank} failed before its body ran: "
                    f"{report['error']}")
        if report:
            return (f"{where(name, attempt)}: worker RANK={rank}'s entry point returned without "
                    f"calling body(rank, world_size, *args)")
        run = runs.get(name)
        tail = f": its last lines:\n{run}" if isinstance(run, str) else ""
        return (f"{where(name, attempt)}: worker RANK={rank} never reported (it hung, or was "
                f"stopped when another worker failed){tail}")

    def probes(name: str, attempt: int):
        """(RANK, probe) of every worker of the attempt; an AssertionError if one has none (a
        worker that says why first: the others were stopped when it failed)."""
        rows = workers(name, attempt)
        lacking = sorted((rank for rank, wrote in rows if "probe" not in wrote),
                         key=lambda r: "report" not in rows[r][1])
        if lacking:
            raise AssertionError(missing(name, attempt, lacking[0], rows[lacking[0]][1]))
        return [(rank, wrote["probe"]) for rank, wrote in rows]

    def joined_problem() -> str | None:
        try:
            for name, tries in attempts.items():
                for attempt in tries:
                    rows = probes(name, attempt)
                    for rank, probe in rows:
                        who = f"{where(name, attempt)}: worker RANK={rank}"
                        if not probe["initialized"]:
                            return (f"{who} ran its body with no process group: "
                                    f"dist.init_process_group(...) was never called, or did not "
                                    f"join (dist.is_initialized() is False)")
                        if probe["group"] != [rank, _world(name)]:
                            g = probe["group"]
                            return (f"{who} is rank {g[0]} of {g[1]} in the group it joined: "
                                    f"every worker must join one group of {_world(name)} as "
                                    f"its own RANK")
                        if "gloo:all_gather" not in probe.get("collectives", []):
                            return (f"{who}: the checker's dist.all_gather_object reached the "
                                    f"other workers, but gloo ran no all-gather"
                                    f"{'' if probe['torch_group'] else ' and torch has no process group'}"
                                    f": the data went through a side channel (a file, the "
                                    f"store) behind a stand-in for torch.distributed, not through "
                                    f"a process group")
                    sent = [probe["me"] for _, probe in rows]
                    for rank, probe in rows:
                        if probe["gathered"] != sent:
                            return (f"{where(name, attempt)}: worker RANK={rank} gathered "
                                    f"{probe['gathered']} from its group, not what each worker "
                                    f"sent ({sent}): the workers are not in one group")
        except AssertionError as exc:
            return str(exc)
        return None

    def joined():
        problem = joined_problem()
        assert problem is None, problem
        return "both runs, every attempt: one gloo group; an all-gather carried every secret"

    def counted():
        if joined_problem():
            raise AssertionError("not counted: the workers did not all join one group as their "
                                 "RANK (see 'every worker joins one process group as its own "
                                 "RANK')")

    def survives():
        counted()
        run = runs.get("A")
        assert not isinstance(run, str), (f"run A did not finish within {LIMIT_S:.0f} s under "
                                          f"torchrun. Its last lines:\n{run}")
        if run.attempts < 2:
            raise AssertionError(
                "torchrun never restarted the group: the checker's fault in worker RANK=1's body "
                "(attempt 0) did not make the worker fail. Does the entry point catch what the "
                "body raises? torchrun restarts the group only when a worker fails")
        errors = [w.get("report", {}).get("error") for _, w in workers("A", last_a)]
        errors = [e for e in errors if e]
        assert run.ok and not errors, (f"run A's restarted attempt failed: "
                                       f"{errors[0] if errors else (run.summary or run.tail(8))}")
        b = runs.get("B")
        assert not isinstance(b, str) and b.ok, (
            f"run B (3 nodes) did not end well: "
            f"{b if isinstance(b, str) else (b.summary or b.tail(8))}")
        ports = [found["A"][(a, 0)]["probe"]["env"]["MASTER_PORT"] for a in attempts["A"]]
        return f"run A joined again after the crash (MASTER_PORT {' then '.join(ports)})"

    def given(arg: str, var: str, local: str):
        def test():
            bad = []
            for name, tries in attempts.items():
                for attempt in tries:
                    for _, probe in probes(name, attempt):
                        if str(probe[arg]) != probe["env"][var]:
                            bad.append((name, probe["env"], probe[arg]))
            if not bad:
                return f"{var} on every worker (run B: RANK 0-2, LOCAL_RANK 0)"
            name, env, got = bad[0]
            read = f"Read int(os.environ[\"{var}\"])"
            if all(str(g) == e.get(local) for _, e, g in bad):
                what = ("LOCAL_RANK, the rank on its node: RANK is the rank in the whole job"
                        if var == "RANK" else "LOCAL_WORLD_SIZE, the workers on its node: "
                        "WORLD_SIZE counts the workers of the whole job")
                raise AssertionError(f"run {name}: {_who(env)} passed {arg}={got}, its {what} "
                                     f"({var}={env[var]}). {read}")
            if len(bad) > 1 and len({str(g) for _, _, g in bad}) == 1:
                raise AssertionError(f"{len(bad)} workers passed {arg}={got} whatever torchrun "
                                     f"set (first: run {name}, {_who(env)}, {var}={env[var]}): "
                                     f"a number written in, not read from the environment. "
                                     f"{read}")
            raise AssertionError(f"run {name}: {_who(env)} passed {arg}={got}, but torchrun set "
                                 f"{var}={env[var]}. {read}")
        return test

    def from_env():
        rows = [(name, attempt, rank, wrote) for name, tries in attempts.items()
                for attempt in tries for rank, wrote in workers(name, attempt)]
        for name, attempt, rank, wrote in rows:
            problems = [c["problem"] for c in wrote.get("inits") or [] if c.get("problem")]
            if problems:
                raise AssertionError(problems[0])
        for name, attempt, rank, wrote in rows:
            calls = wrote.get("inits") or []
            if not calls and ("probe" in wrote or "report" in wrote):
                raise AssertionError(
                    f"{where(name, attempt)}: worker RANK={rank} never called "
                    f"dist.init_process_group: call it with the backend alone, and it reads "
                    f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun")
            if len(calls) > 1:
                raise AssertionError(f"{where(name, attempt)}: worker RANK={rank} called "
                                     f"init_process_group {len(calls)} times: once joins")
        for name, attempt, rank, wrote in rows:
            if not wrote.get("inits"):
                raise AssertionError(missing(name, attempt, rank, wrote))
        return "one init_process_group per worker, from torchrun's environment"

    def leaves():
        counted()
        for name, tries in attempts.items():
            for rank, wrote in workers(name, tries[-1]):
                assert "report" in wrote, missing(name, tries[-1], rank, wrote)
                assert not wrote["report"]["pg_left"], (
                    f"run {name}: worker RANK={rank}'s entry point returned with its process "
                    f"group still there: call dist.destroy_process_group() in a finally: block")
        return "no group left behind"

    def own_lines():
        counted()
        from ...grading.references import reference_problem
        for name, tries in attempts.items():
            for attempt in tries:
                for rank, wrote in workers(name, attempt):
                    used = wrote.get("report", {}).get("references") or []
                    assert not used, f"run {name}, worker RANK={rank}: {reference_problem(used)}"
        return "no lab code ran"

    return [case("every worker joins one process group as its own RANK", joined),
            case("rank is the worker's RANK, not its LOCAL_RANK (3 nodes)",
                 given("rank", "RANK", "LOCAL_RANK")),
            case("world_size is WORLD_SIZE, not a number written in (a job of 3)",
                 given("world_size", "WORLD_SIZE", "LOCAL_WORLD_SIZE")),
            case("init_process_group takes the job from torchrun's environment", from_env),
            case("survives a crash: torchrun restarts it and it joins again", survives),
            case("destroys the process group", leaves),
            case("joins by itself, not with the lab's torchrun_main", own_lines)]
