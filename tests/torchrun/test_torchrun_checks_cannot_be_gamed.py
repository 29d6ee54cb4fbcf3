"""The torchrun exercise (05.train_ddp) cannot be passed by one process training alone.

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
