"""Notebook 01's experiments: drifting replicas vs data parallel, a 2-stage pipeline, memory."""
from __future__ import annotations

import pytest

import labkit as lk
from labkit import data_vs_model as P
from labkit.common.timeline import Timeline, align, busy_seconds, idle_fraction

from conftest import assert_no_ranks_left

pytestmark = pytest.mark.timeout(90)


def test_independent_replicas_drift_and_data_parallel_ones_stay_identical():
    alone = P.replica_drift(world_size=4, steps=8, data_parallel=False)
    together = P.replica_drift(world_size=4, steps=8, data_parallel=True)
    assert len(alone["checksums"]) == 4 and len(alone["checksums"][0]) == 8
    assert alone["spread"][-1] > 1e-3 and alone["distance"][-1] > 1e-3
    assert together["spread"] == [0.0] * 8          # exactly: bit-identical replicas
    assert together["distance"] == [0.0] * 8
    # same data and init in both runs: the first step's losses agree, only the sync differs
    assert alone["losses"][2][0] == together["losses"][2][0]


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_pipeline_split_across_two_ranks_matches_the_whole_model(micro_batches):
    width, depth = 32, 2
    res = P.pipeline(micro_batches=micro_batches, width=width, depth=depth, batch=16, steps=2)
    assert res["max_grad_diff"] < 1e-5
    assert res["params"] == [depth * (width * width + width)] * 2
    for rank, spans in enumerate(res["spans"]):
        kinds = [s["kind"] for s in spans]
        assert kinds.count("forward") == micro_batches and kinds.count("backward") == micro_batches
        assert "idle" in kinds                      # each stage waits for the other at some point
        assert all(s["rank"] == rank for s in spans)
    assert min(s["start"] for r in res["spans"] for s in r) == 0.0
    assert all(0.0 < f < 1.0 for f in res["idle"])


def test_split_layers_places_consecutive_layers_by_their_middle():
    assert P.split_layers([10, 10, 10, 10], 2) == [20, 20]
    assert P.split_layers([1, 100, 1], 2) == [1, 101]
    assert P.split_layers([5, 5, 5], 4) == [5, 0, 5, 5]
    assert sum(P.split_layers([3, 7, 2, 9, 4], 3)) == 25


def test_memory_table_uses_real_parameter_counts():
    gpt2 = P.gpt_like()                               # GPT-2 small's shape, on the meta device
    total = sum(p.numel() for p in gpt2.parameters())
    assert total == 124_439_808                       # the published GPT-2 small count
    assert all(p.device.type == "meta" for p in gpt2.parameters())
    rows = {r["strategy"]: r for r in P.memory_table(gpt2, 4)}
    assert rows["data parallel (DDP)"]["params"] == total == rows["1 GPU"]["params"]
    assert rows["FSDP / ZeRO-3"]["params"] == -(-total // 4)
    assert total // 4 <= rows["model parallel (pipeline)"]["params"] < total
    assert rows["1 GPU"]["GB"] == pytest.approx(total * 16 / 1e9)


def test_timeline_helpers():
    tl = Timeline(rank=1)
    tl.add("forward", 10.0, 11.0)
    tl.add("idle", 11.0, 13.0)
    tl.add("all_reduce", 10.5, 12.0, lane="comm")
    with tl.span("step"):
        pass
    assert tl.spans[0] == {"rank": 1, "lane": "compute", "kind": "forward", "label": "",
                           "start": 10.0, "end": 11.0}
    assert busy_seconds(tl.spans[:3]) == pytest.approx(3.0)     # overlaps counted once
    assert idle_fraction(tl.spans[:3]) == pytest.approx(2 / 3)
    shifted = align([tl.spans[:2], [{**tl.spans[0], "start": 9.0, "rank": 0}]])
    assert shifted[1][0]["start"] == 0.0 and shifted[0][0]["start"] == 1.0


def test_no_rank_outlives_the_tests():
    lk.shutdown()
    assert_no_ranks_left()


def test_fastest_step_picks_the_shortest_repeat_for_every_rank():
    def span(rank, start, end):
        return {"rank": rank, "lane": "compute", "kind": "forward", "label": "",
                "start": start, "end": end}
    steps = [[[span(0, 0, 5)], [span(0, 10, 11)]],      # rank 0: step 0 long, step 1 short
             [[span(1, 0, 1)], [span(1, 10, 12)]]]
    from labkit.common.timeline import fastest_step
    chosen = fastest_step(steps)
    assert chosen == [[span(0, 10, 11)], [span(1, 10, 12)]]   # step 1 lasts 2 s, step 0 lasts 5 s


def test_measure_overlap_records_one_comm_span_per_bucket_on_every_rank():
    from labkit.ddp import overlap
    res = overlap.measure_overlap(world_size=2, caps=(0.0, 25.0), width=32, depth=3, batch=8,
                                  steps=2)
    assert res["buckets"] == {0.0: 6, 25.0: 1}
    assert res["checksums_equal"]
    for cap, per_rank in res["runs"].items():
        assert len(per_rank) == 2
        for spans in per_rank:
            comm = [s for s in spans if s["kind"] == "all_reduce"]
            assert len(comm) == res["buckets"][cap]
            backward = next(s for s in spans if s["kind"] == "backward")
            if cap == 0.0:      # one bucket per tensor: the first launches during backward
                assert min(s["start"] for s in comm) < backward["end"]
            assert {"forward", "backward", "idle", "step"} <= {s["kind"] for s in spans}
    assert overlap.fastest_cap(res) in (0.0, 25.0)
    assert overlap.fastest_cap({"step_ms": {1.0: [5.0, 9.0], 3.0: [6.0, 6.5]}}) == 3.0
    with pytest.raises(ValueError, match="measure_overlap"):
        overlap.fastest_cap(None)

