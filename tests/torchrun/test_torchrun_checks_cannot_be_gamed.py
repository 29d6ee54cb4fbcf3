"""Notebook 05's checkers cannot be gamed: the core build (05.torchrun_lines, below the
DDP exercise's tests) and the DDP exercise (05.train_ddp).

05.train_ddp cannot be passed by one process training alone.

Before, the checker compared final parameters only: a ``train_ddp`` that returned
``lk.torchrun.check.oracle(...)`` (or trained the whole dataset alone in each worker, in the
sampler's order) scored full marks without a process group. Now each worker must build its
own DistributedSampler shard and all-reduce every gradient every step (gloo's flight recorder),
and the cases one process alone passes idly count only for such a run. The classes of
shortcut, and the answers that feed them:

* hidden state: n.a.: each grading launches fresh torchrun workers, whose data and order are
  the exercise's own (nothing is secret to keep), and they are judged on what they ran;
* the library doing the work: n.a.: the exercise is to use torch's DDP;
* a copied oracle: ``returns_the_oracle`` (the checker's own ``oracle``);
* a side channel: ``averages_through_the_store`` (each worker its own shard, the gradients
  averaged through the process group's TCPStore); a collective from another thread is seen
  (the flight recorder is the process's, see tests/collectives);
* a computation not split as required: ``ddp_on_the_whole_dataset``.
"""
from __future__ import annotations

import pytest

from labkit.torchrun.check import check_torchrun_exercise

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
SYNC = "shards the data and all-reduces the gradients"
IDLE = ["every rank ends with the same parameters", "equals one process on the global batch",
        "destroys the process group", "only rank 0 prints"]


def returns_the_oracle(epochs=2, batch_size=64, lr=0.1):
    from labkit.torchrun.check import oracle
    return oracle(epochs, batch_size, lr)


def ddp_on_the_whole_dataset(epochs=2, batch_size=64, lr=0.1):
    """DDP, but no sharding: every rank walks the whole dataset in the oracle's order."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import labkit as lk
    dist.init_process_group("gloo")
    try:
        data = lk.train.make_dataset()
        model = DDP(lk.train.make_model(dropout=0.0))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return model.module.state_dict()
    finally:
        dist.destroy_process_group()


def averages_through_the_store(epochs=2, batch_size=64, lr=0.1):
    """Its own DistributedSampler shard, but the gradients averaged through the TCPStore."""
    import io

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    import labkit as lk
    dist.init_process_group("gloo")
    try:
        store, n, me = dist.distributed_c10d._get_default_store(), dist.get_world_size(), \
            dist.get_rank()
        data = lk.train.make_dataset()
        model = lk.train.make_model(dropout=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=batch_size // n, sampler=sampler)
        step = 0
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                buf = io.BytesIO()
                torch.save([p.grad for p in model.parameters()], buf)
                store.set(f"side/{step}/{me}", buf.getvalue())
                every = [torch.load(io.BytesIO(store.get(f"side/{step}/{r}"))) for r in range(n)]
                for i, p in enumerate(model.parameters()):
                    p.grad = sum(e[i] for e in every) / n
                opt.step()
                step += 1
        dist.barrier()      # rank 0's process hosts the store: nobody reads it after this
        return model.state_dict()
    finally:
        dist.destroy_process_group()


def oracle_behind_decoys(epochs=2, batch_size=64, lr=0.1):
    """Everything the checker counts, nothing it needs: its own sampler shard walked, zeros of
    the model's size all-reduced every step, and the checker's oracle returned."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    import labkit as lk
    from labkit.torchrun.check import oracle
    dist.init_process_group("gloo")
    try:
        data, n = lk.train.make_dataset(), dist.get_world_size()
        decoy = torch.zeros(sum(p.numel() for p in lk.train.make_model().parameters()))
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            order = list(sampler)
            for _ in range(0, len(order), batch_size // n):
                dist.all_reduce(decoy)
        return oracle(epochs, batch_size, lr)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("answer, failing, words", [
    (oracle_behind_decoys, IDLE, "DistributedDataParallel"),
    (averages_through_the_store, IDLE, "through a side channel such as the process group's "
                                       "TCPStore"),
    (returns_the_oracle, IDLE, "rank 0 built no DistributedSampler(num_replicas=2, rank=0)"),
    (ddp_on_the_whole_dataset, IDLE, "(only [(1, 0)])"),
])
def test_training_that_is_not_data_parallel_fails_a_named_case(answer, failing, words):
    cases = {c.name: c for c in check_torchrun_exercise(answer)}
    assert [n for n, c in cases.items() if c.passed] == ["runs under torchrun on 2 ranks"]
    assert words in cases[SYNC].detail, cases[SYNC].detail
    for name in failing:                  # what one process alone passes idly does not count
        assert cases[name].detail.startswith("not counted: the workers did not train"), name


def test_gradients_averaged_once_instead_of_every_step_are_not_enough():
    """Pure logic (no launch): a worker with its shard that all-reduced the parameters once."""
    from labkit.torchrun.check import EXERCISE_KWARGS, _sync_problem
    from labkit.torchrun.train import make_model
    params = sum(p.numel() for p in make_model(dropout=0.0).parameters())
    report = {"rank": 1, "value": {"samplers": [{"replicas": 2, "rank": 1, "epochs": [0, 1]}],
                                   "collectives": [("gloo:all_reduce", params)] * 4}}
    problem = _sync_problem(report, 2, EXERCISE_KWARGS)
    assert problem.startswith(f"rank 1 all-reduced {4 * params} elements in all") and \
        "DistributedDataParallel(model)" in problem
    every_step = {**report["value"], "collectives": [("gloo:all_reduce", params)] * 64}
    assert _sync_problem({"rank": 1, "value": every_step}, 2, EXERCISE_KWARGS) is None


# ====================================================================== 05.torchrun_lines
# The core build: the lines that make a plain script a torchrun script (labkit/torchrun/check/
# lines.py). Every answer below runs under real torchrun (run A: 2 workers, a crash, a restart;
# run B: 3 nodes on loopback) and must fail a case that names what it did:
#
# * lazy and wrong answers: ``hard_codes_rank_0_and_swallows_the_failure`` (no worker fails, so
#   torchrun never restarts), ``hard_codes_world_size_2_and_never_destroys``,
#   ``reads_local_rank`` (LOCAL_RANK for RANK: 0 on every node of run B), ``never_joins``,
#   ``joins_its_own_address`` (init without the environment: a fixed tcp:// port). The first
#   two make two mistakes each, graded in one pair of launches (two torchrun runs cost ~22 s of
#   CPU: eleven processes importing torch): the mistakes are judged on different evidence (the
#   rank or world size the body was given; whether torchrun restarted, whether a group was
#   left), and each must fail its own case, with its own words;
# * the lab's own code doing the work: ``calls_the_lab`` (lk.torchrun.torchrun_main, a
#   labkit.grading.references reference);
# * a side channel: ``joins_through_a_file`` (init_method="file://..."), and
#   ``fakes_the_group_through_the_store``: no process group at all, a stand-in for
#   torch.distributed whose all_gather_object moves the data through the TCPStore at
#   MASTER_PORT (gloo's flight recorder sees no all-gather; a stand-in moving it through files
#   is the same case and is judged the same way);
# * hidden state: n.a.: every worker of every attempt is a fresh process, judged on what it ran;
#   a copied oracle: n.a.: the secrets gathered are drawn in each worker after it joined;
#   a computation not split: n.a.: the build splits nothing.

LINES_ALL = ["every worker joins one process group as its own RANK",
             "rank is the worker's RANK, not its LOCAL_RANK (3 nodes)",
             "world_size is WORLD_SIZE, not a number written in (a job of 3)",
             "init_process_group takes the job from torchrun's environment",
             "survives a crash: torchrun restarts it and it joins again",
             "destroys the process group",
             "joins by itself, not with the lab's torchrun_main"]
JOINS, RANK_CASE, WORLD_CASE, FROM_ENV, SURVIVES, DESTROYS, OWN = LINES_ALL


def lines_answer(body, *args):
    """The right lines (the notebook's): each wrong answer below differs from them in one place."""
    import os

    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def hard_codes_rank_0_and_swallows_the_failure(body, *args):
    import os

    import torch.distributed as dist
    rank, world_size = 0, int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        return body(rank, world_size, *args)
    except Exception as exc:                         # noqa: BLE001
        print(f"rank {rank}: ignored {exc}")
    finally:
        dist.destroy_process_group()


def hard_codes_world_size_2_and_never_destroys(body, *args):
    import os

    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), 2
    dist.init_process_group("gloo")
    return body(rank, world_size, *args)


def reads_local_rank(body, *args):
    import os

    import torch.distributed as dist
    rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def never_joins(body, *args):
    import os
    return body(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)


def joins_its_own_address(body, *args):
    """init_process_group on a fixed port of its own, as a tutorial's MASTER_PORT=12355."""
    import os

    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29512", rank=rank,
                            world_size=world_size)
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def joins_through_a_file(body, *args):
    """A real group, met through a file instead of torchrun's rendezvous."""
    import os

    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    path = f"/tmp/labkit-side-{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world_size)
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def calls_the_lab(body, *args):
    import labkit as lk
    return lk.torchrun.torchrun_main(body, *args)


def _stand_in(gather):
    """Patch torch.distributed so that a script sees a group that does not exist: ``gather(obj)``
    returns every worker's object, moved some other way."""
    import os

    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def all_gather_object(out, obj, group=None):
        out[:] = gather(obj)

    dist.is_initialized = lambda: True
    dist.get_rank = lambda group=None: rank
    dist.get_world_size = lambda group=None: world
    dist.get_backend = lambda group=None: "gloo"
    dist.all_gather_object = all_gather_object
    dist.destroy_process_group = lambda group=None: None
    return rank, world


def fakes_the_group_through_the_store(body, *args):
    import os
    import pickle

    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0)
    count = [0]

    def gather(obj):
        count[0] += 1
        store.set(f"side/{count[0]}/{rank}", pickle.dumps(obj))
        return [pickle.loads(store.get(f"side/{count[0]}/{r}")) for r in range(world)]

    _stand_in(gather)
    return body(rank, world, *args)


def _lines_cases(answer):
    import glob
    import shutil

    from labkit.torchrun.check.lines import check_torchrun_lines
    before = set(glob.glob("/tmp/labkit-side-*"))
    try:
        cases = check_torchrun_lines(answer)
    finally:                                  # what the side-channel answers left behind
        for path in set(glob.glob("/tmp/labkit-side-*")) - before:
            shutil.rmtree(path, ignore_errors=True)
    assert [c.name for c in cases] == LINES_ALL
    return {c.name: c for c in cases}


# The right lines' full marks are not checked again here (two torchrun launches, 20 s):
# solutions/05_torchrun.ipynb grades its torchrun_main with this checker in every test run, and
# the lab's pytest plugin (LABKIT_EXPECT_SOLVED) fails that cell unless every case passes; each
# answer below differs from those lines in one place and fails only the case that names it.


NOT_JOINED = "not counted: the workers did not all join one group"


@pytest.mark.parametrize("answer, failing", [
    (hard_codes_rank_0_and_swallows_the_failure,
     {RANK_CASE: "passed rank=0 whatever torchrun set",
      SURVIVES: "torchrun never restarted the group"}),
    (hard_codes_world_size_2_and_never_destroys,
     {WORLD_CASE: "passed world_size=2 whatever torchrun set",
      DESTROYS: "call dist.destroy_process_group() in a finally: block"}),
    (reads_local_rank, {RANK_CASE: "its LOCAL_RANK, the rank on its node"}),
    (calls_the_lab, {OWN: "lk's torchrun.entry.torchrun_main ran inside your answer"}),
])
def test_a_wrong_line_fails_the_case_that_names_it(answer, failing):
    cases = _lines_cases(answer)
    assert [n for n, c in cases.items() if not c.passed] == \
        [n for n in LINES_ALL if n in failing], {n: c.detail for n, c in cases.items()}
    for name, words in failing.items():
        assert words in cases[name].detail, (name, cases[name].detail)


@pytest.mark.parametrize("answer, words", [
    (never_joins, "ran its body with no process group"),
    (joins_its_own_address, "init_method='tcp://127.0.0.1:29512'"),
    (joins_through_a_file, "init_method='file:///tmp/labkit-side-"),
    (fakes_the_group_through_the_store, "gloo ran no all-gather and torch has no process "
                                        "group: the data went through a side channel"),
])
def test_a_group_not_joined_from_torchruns_environment_fails_by_name(answer, words):
    """No group, or one met elsewhere: the join case names it, and what the workers pass idly
    without a group (the restart, the cleanup, no lab code) is not counted."""
    cases = _lines_cases(answer)
    assert not cases[JOINS].passed
    where = cases[FROM_ENV] if "init_method" in words else cases[JOINS]
    assert words in where.detail, {n: c.detail for n, c in cases.items()}
    for name in (SURVIVES, DESTROYS, OWN):
        assert cases[name].detail.startswith(NOT_JOINED), (name, cases[name].detail)


def test_an_init_that_ignores_the_environment_is_named_before_it_can_hang():
    """Pure logic: what the harness stops, and why (no launch)."""
    from labkit.torchrun.check.lines import _init_problem
    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "localhost",
           "MASTER_PORT": "41311"}

    def call(**kw):
        return {"store": None, "init_method": None, "rank": -1, "world_size": -1,
                "env": dict(env), **kw}
    assert _init_problem(call(), env) is None
    assert _init_problem(call(rank=2, world_size=3, init_method="env://"), env) is None
    assert _init_problem(call(init_method="tcp://localhost:41311"), env) is None
    assert "init_process_group(rank=0), but torchrun made it RANK=2" in \
        _init_problem(call(rank=0), env)                     # LOCAL_RANK handed to init
    assert "init_process_group(world_size=2)" in _init_problem(call(world_size=2), env)
    assert "a store of its own" in _init_problem(call(store="FileStore"), env)
    moved = call()
    moved["env"]["MASTER_PORT"] = "29500"
    assert "MASTER_PORT was 41311 from torchrun and 29500" in _init_problem(moved, env)


def test_a_stub_is_not_done_without_launching(monkeypatch):
    from labkit.torchrun.check import lines
    monkeypatch.setattr(lines, "_launch", lambda *a: pytest.fail("launched a stub"))

    def torchrun_main(body, *args):
        raise NotImplementedError("torchrun_main: write your code here")
    with pytest.raises(NotImplementedError):
        lines.check_torchrun_lines(torchrun_main)
