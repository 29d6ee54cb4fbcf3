"""HandZero (notebook 06 §4) on models that are not an MLP of nn.Linear, against one process.

Every trainable parameter of any module is averaged and updated, frozen ones stay bit for bit
what they were, and what cannot be sharded is refused up front with the parameter's name.
One job per world size runs every model, stage and optimizer; the oracle is ``torch.optim``
on the whole model and the global batch, in this process.
"""
from __future__ import annotations

import contextlib
import gc
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import labkit as lk
from labkit.sharding.zero import HandZero

from conftest import assert_no_ranks_left

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, SEED, VOCAB, PER_RANK, TOKENS = 3, 100, 7, 4, 5
OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 1e-2}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


class Shift(nn.Module):
    """A module with a bias and nothing else."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.bias


class AnyModel(nn.Module):
    """An embedding, a frozen layer, a LayerNorm, a bias-only module, a layer whose bias is
    frozen and a parameter of the root's own. Trainable per module: 3, 35, 10, 5, 15 elements
    (no world size divides them)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.randn(3))
        self.emb = nn.Embedding(VOCAB, 5)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.norm = nn.LayerNorm(5)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.shift = Shift(5)
        self.head = nn.Linear(5, 3)
        self.head.bias.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.emb(idx)))
        return self.head(self.shift(self.norm(h))).mean(1) * self.scale


class TiedModel(nn.Module):
    """An embedding tied to the output layer (one parameter in two modules): stages 1 and 2."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 5)
        self.mix = nn.Linear(5, 5)
        self.out = nn.Linear(5, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(idx)))).mean(1)


MODELS = {"any": (AnyModel, 3), "tied": (TiedModel, VOCAB)}       # (class, output width)
UNITS = {"any": [3, 35, 10, 5, 15], "tied": [35, 30]}              # trainable elements per module
FROZEN = {"any": 25 + 5 + 3, "tied": 0}


def batch(step: int, rows: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (rows, TOKENS), generator=g), torch.randn(rows, out, generator=g)


def cases(world_size: int) -> list[tuple[str, int, str, str]]:
    """(model, stage, optimizer, collectives): every model, stage and optimizer; each stage
    runs once with the ring's collectives and once with torch's."""
    out = []
    for name in MODELS:
        for stage in ((1, 2, 3) if name == "any" else (1, 2)):
            for k, opt in enumerate(OPTIMIZERS):
                out.append((name, stage, opt, ("ring", "dist")[(stage + k) % 2]))
    return out


def train_all(rank: int, world_size: int) -> dict:
    """(In a rank.) Each case from a different seed on every rank: full parameters every step,
    the last step's counted sends, what stays gathered after it, the bytes of parameters."""
    from labkit.sharding.counting import CommCounter
    results = {}
    for name, stage, opt, collectives in cases(world_size):
        cls, width = MODELS[name]
        zero = HandZero(cls(SEED + rank), stage, OPTIMIZERS[opt][1]["lr"], collectives,
                        optimizer=opt, momentum=0.9)
        steps, comm = [], CommCounter()
        for step in range(STEPS):
            x, y = batch(step, PER_RANK * world_size, width)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            with comm if step == STEPS - 1 else contextlib.nullcontext():
                F.mse_loss(zero.module(x[rows]), y[rows]).backward()
                zero.step()
            zero.zero_grad()
            steps.append(zero.full_parameters())
        results[(name, stage, opt)] = {"steps": steps, "sent": comm.ring_sent(),
                                       "live": zero.meter.live,
                                       "params": zero.memory()["params"]}
    return results


def oracle(name: str, opt: str, world_size: int) -> list[list[torch.Tensor]]:
    """One process, the global batch, torch.optim: every parameter after every step."""
    cls, width = MODELS[name]
    model = cls(SEED)
    make, kwargs = OPTIMIZERS[opt]
    optimizer = make(model.parameters(), **kwargs)
    out = []
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * world_size, width)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_stage_trains_any_model_like_one_process_on_every_rank_every_step(world_size):
    runs = lk.run(train_all, world_size, timeout=120, echo=False).values
    n = world_size
    oracles = {(name, opt): oracle(name, opt, n) for name in MODELS for opt in OPTIMIZERS}
    for name, stage, opt, collectives in cases(n):
        start = [(qual, p.detach(), p.requires_grad)
                 for qual, p in MODELS[name][0](SEED).named_parameters()]
        for rank, per_rank in enumerate(runs):
            row = per_rank[(name, stage, opt)]
            where = f"{name} model, ZeRO-{stage}, {opt}, {collectives}, rank {rank}"
            for step, (got, want) in enumerate(zip(row["steps"], oracles[name, opt])):
                assert len(got) == len(want), where
                for a, b, (qual, p0, trainable) in zip(got, want, start):
                    if trainable:
                        assert (a - b).abs().max() < 1e-5, f"{where}, step {step}: {qual}"
                        assert not torch.equal(a, p0), f"{where}: {qual} never trained"
                    else:
                        assert torch.equal(a, p0), f"{where}: frozen {qual} changed"
            padded = sum(-(-k // n) * n for k in UNITS[name])       # each unit padded to N
            halves = 3 if stage == 3 else 2
            assert row["sent"] == halves * 4 * padded * (n - 1) / n, where
            assert row["live"] == 0, where                             # nothing left gathered
            if stage == 3:                                             # shards + frozen, whole
                assert row["params"] == 4 * (padded // n + FROZEN[name]), where


class Half(nn.Module):
    """Two parameters, of which the forward uses one."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.used


class Unused(nn.Module):
    """``spare`` (a module never called) or ``part.unused`` (a parameter its module's forward
    does not use) is trainable and gets no gradient on any rank."""

    def __init__(self, seed: int, spare: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 2)
        self.part = nn.Identity() if spare else Half()
        self.spare = nn.Linear(4, 2) if spare else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(self.fc(x))


def full_size_tensors_alive(zero: HandZero) -> int:
    """Tensors alive in this process whose storage is the size of a unit's full parameters."""
    gc.collect()
    sizes = {4 * u.layout.padded for u in zero.units}
    return sum(1 for o in gc.get_objects()
               if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() in sizes)


def edge_cases(rank: int, world_size: int) -> tuple[list, list, list]:
    """(In a rank.) The error of each stage on each Unused model; per stage, the largest
    difference between one backward of the whole batch and two of its halves (accumulated);
    under ZeRO-3, full-size tensors alive after forward and after the step (the lesson's MLP)."""
    from labkit.sharding.model import make_mlp, rank_batch
    zero = HandZero(make_mlp(seed=rank), 3)
    mx, my = rank_batch(rank, world_size)
    loss = F.mse_loss(zero.module(mx), my)
    alive = [full_size_tensors_alive(zero)]
    loss.backward()
    zero.step()
    alive.append(full_size_tensors_alive(zero))
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank)), torch.zeros(4, 2)
    errors, accumulated = [], []
    for stage in (1, 2, 3):
        for spare in (True, False):
            zero = HandZero(Unused(rank, spare), stage)
            try:
                F.mse_loss(zero.module(x), y).backward()
                zero.step()
                errors.append("no error")
            except RuntimeError as err:
                errors.append(str(err))
        one, two = (HandZero(_dense(rank), stage) for _ in range(2))
        F.mse_loss(one.module(x), y).backward()
        for rows in (slice(0, 2), slice(2, 4)):
            (F.mse_loss(two.module(x[rows]), y[rows]) / 2).backward()
        one.step(), two.step()
        accumulated.append(max(float((a - b).abs().max())
                               for a, b in zip(one.full_parameters(), two.full_parameters())))
    return errors, accumulated, alive


def _dense(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.LayerNorm(3), nn.Linear(3, 2))


@pytest.mark.timeout(60)
def test_no_gradient_is_refused_by_name_accumulation_adds_up_zero3_keeps_nothing_full():
    for errors, accumulated, alive in lk.run(edge_cases, 2, timeout=30, echo=False).values:
        assert alive == [0, 0], "ZeRO-3 keeps full parameters after forward / after the step"
        for (stage, spare), msg in zip([(s, sp) for s in (1, 2, 3) for sp in (True, False)],
                                       errors):
            names = ("spare.weight", "spare.bias") if spare else ("part.unused",)
            assert "no gradient" in msg and all(f"'{n}'" in msg for n in names), \
                (stage, spare, msg)
        assert max(accumulated) < 1e-6, accumulated


class Extras(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.extra = nn.ParameterList([nn.Parameter(torch.ones(3))])

    def forward(self, x):
        return self.fc(x) * self.extra[0]


def _tied():
    return TiedModel(0)


def _lstm():
    return nn.Sequential(nn.LSTM(3, 4))


def _sparse():
    return nn.Sequential(nn.Embedding(5, 3, sparse=True))


def _lazy():
    return nn.Sequential(nn.LazyLinear(3))


@pytest.mark.parametrize("make, stages, names, why", [
    (_tied, (3,), ("out.weight", "emb.weight"), "shared"),
    (Extras, (3,), ("extra.0",), "no forward of its own"),
    (_lstm, (3,), ("0.weight_ih_l0",), "its own reference"),
    (_sparse, (1, 2, 3), ("0.weight",), "sparse"),
    (_lazy, (1, 2, 3), ("0.weight",), "uninitialized"),
])
def test_what_hand_zero_cannot_shard_is_refused_up_front_by_name(make, stages, names, why):
    for stage in stages:                     # raised before any process group is needed
        with pytest.raises(ValueError) as err:
            HandZero(make(), stage)
        msg = str(err.value)
        assert why in msg and all(f"'{n}'" in msg for n in names), (stage, msg)


def test_hand_zero_rejects_an_optimizer_it_does_not_have():
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd'"):
        HandZero(nn.Linear(2, 2), stage=1, optimizer="lamb")


def test_no_rank_outlives_the_jobs():
    lk.shutdown()
    assert_no_ranks_left()
