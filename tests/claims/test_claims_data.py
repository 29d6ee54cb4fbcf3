"""Claim tests: what `DistributedSampler` hands each rank (torch 2.13.0). Pure logic: the sampler
needs only `num_replicas` and `rank`, no process group. Each docstring quotes the sentence it backs.
"""
from __future__ import annotations

import sys
from collections import Counter

from torch.utils.data import DistributedSampler

import _claims


def shards(n: int, world_size: int, **kw) -> list[list[int]]:
    return [list(DistributedSampler(range(n), num_replicas=world_size, rank=r, **kw))
            for r in range(world_size)]


def test_shards_are_disjoint_except_for_the_padding():
    """02 "Step 2 · Scatter": “the shards are disjoint except for the padding”."""
    for n, world in [(10, 4), (16, 2), (7, 3)]:
        got = shards(n, world, shuffle=True, seed=0)
        counts = Counter(i for shard in got for i in shard)
        padding = -n % world                            # ceil(n / world) * world - n
        assert set(counts) == set(range(n)) and all(len(s) == -(-n // world) for s in got)
        assert sum(c - 1 for c in counts.values()) == padding   # repeats = exactly the padding
    assert [len(s) for s in shards(10, 4, shuffle=False, drop_last=True)] == [2, 2, 2, 2]


def test_padding_skews_an_evaluation_metric():
    """02 "Step 2 · Scatter": “padding also skews evaluation metrics: the repeated samples are
    counted twice”."""
    correct = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]            # 10 samples, 80 % right
    got = shards(len(correct), 4, shuffle=False)        # 12 indices: 0 and 1 come twice
    seen = [correct[i] for shard in got for i in shard]
    assert len(seen) == 12 and sum(seen) / len(seen) == 10 / 12 != sum(correct) / len(correct)


def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])

