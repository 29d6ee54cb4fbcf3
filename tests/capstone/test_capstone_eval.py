"""Distributed evaluation equals one process EXACTLY (1-4 ranks, DDP and FSDP2), and the usual mistakes do not.

Notebook 08, "Evaluating on every rank": each rank evaluates its DistributedSampler
share, the padding duplicates are not counted, sum(loss x tokens) and sum(tokens)
are all-reduced.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labkit as lk
from capstone_common import no_ranks_at_the_end
from labkit.capstone import data as D
from labkit.capstone import evaluate as E
from labkit.capstone import model as M
from labkit.capstone import train_gpt as G

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow,
              pytest.mark.usefixtures("no_ranks_at_the_end")]
__all__ = ["no_ranks_at_the_end"]

CFG = M.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
N_WINDOWS = 10                 # 3 ranks pad 2 duplicates, 4 ranks pad 2; 2 ranks none


def _val() -> torch.utils.data.Dataset:
    return torch.utils.data.Subset(D.Windows(D.load_corpus(20_000).val, 32), range(N_WINDOWS))


def _model(parallel: str = "none") -> torch.nn.Module:
    model = M.make_gpt(CFG, seed=3)
    with torch.no_grad():                       # not a fresh init: windows get distinct losses
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return G.wrap(model, parallel, world, torch.device("cpu")) if parallel != "none" else model


def _evaluate(rank: int, world_size: int, parallel: str) -> float:
    return E.evaluate(_model(parallel), _val(), batch_size=4, device=torch.device("cpu")).loss


def _mean_of_rank_means(rank: int, world_size: int) -> float:
    """A common mistake: average each rank's mean, over what the sampler gave (padding included)."""
    model, data = _model().eval(), _val()
    idx = list(torch.utils.data.DistributedSampler(data, world_size, rank, shuffle=False))
    with torch.no_grad():
        _, loss = model(torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx]))
    dist.all_reduce(loss)
    return loss.item() / world_size


def _padding_counted(rank: int, world_size: int) -> float:
    """Sums all-reduced as they should be, but the duplicates counted."""
    real = E.rank_windows
    E.rank_windows = lambda n, r, w: (real(n, r, w)[0], [True] * len(real(n, r, w)[0]))
    try:
        return _evaluate(rank, world_size, "ddp")
    finally:
        E.rank_windows = real


@pytest.fixture(scope="module")
def single() -> float:
    """The oracle: one process, every window once, in order."""
    return E.evaluate(_model(), _val(), batch_size=4, device=torch.device("cpu")).loss


@pytest.mark.parametrize("world_size, parallel", [(1, "ddp"), (2, "ddp"), (2, "fsdp"),
                                                  (3, "ddp"), (3, "fsdp"), (4, "ddp")])
def test_distributed_eval_equals_one_process_exactly(single, world_size, parallel):
    values = lk.run(_evaluate, world_size, args=(parallel,), echo=False, timeout=60).values
    assert values == [single] * world_size          # ==, not approx, on every rank


def test_eval_in_one_process_counts_every_window_once():
    res = E.evaluate(_model(), _val(), batch_size=3, device=torch.device("cpu"))
    assert (res.windows, res.tokens) == (N_WINDOWS, N_WINDOWS * 32)


def test_eval_leaves_the_model_in_training_mode():
    model = _model().train()
    E.evaluate(model, _val(), batch_size=4, device=torch.device("cpu"))
    assert model.training


@pytest.mark.parametrize("mistake", [_mean_of_rank_means, _padding_counted])
def test_the_usual_mistakes_give_another_number(single, mistake):
    values = lk.run(mistake, 3, echo=False, timeout=60).values
    assert all(abs(v - single) > 1e-5 for v in values), (values, single)
