"""lk.diagnosis: verdicts from per-rank evidence.

Pure tests feed diagnose() RankResults carrying the exact texts torch 2.13.0 / gloo
produced in real runs (copied from them); the real jobs behind every scenario are in
tests/pitfalls/test_pitfalls.py. A few real jobs here check check_replicas() inside a job.
"""
from __future__ import annotations

import pytest
import torch
from conftest import assert_no_ranks_left

import labkit as lk
from labkit.diagnosis import (Fingerprint, FlightRecord, ShardLog, Verdict, compare_fingerprints,
                              compare_flight_records, compare_shards, diagnose)
from labkit.diagnosis.findings import tb_frames
from labkit.runtime.result import JobResult, RankResult

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/"
TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
           "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete")
RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
         "Read error [127.0.0.1]:45764: Connection reset by peer. This is typically caused by a "
         "remote worker hanging or bugs in the application.")


def tb(line: int, code: str, op: str) -> str:
    return (f'Traceback (most recent call last):\n  File "/home/me/step.py", line {line}, in step\n'
            f'    {code}\n  File "{TORCH}c10d_logger.py", line 83, in wrapper\n'
            f'    return func(*args, **kwargs)\n  File "{TORCH}distributed_c10d.py", line 3252, '
            f'in {op}\n    work.wait()\n')


def stack(line: int, op: str | None) -> str:
    inner = (f'  File "{TORCH}distributed_c10d.py", line 3252 in {op}\n'
             f'  File "{TORCH}c10d_logger.py", line 83 in wrapper\n') if op else \
        '  File "/home/me/data.py", line 9 in load\n'
    return ("Thread 0x00007f (most recent call first):\n" + inner +
            f'  File "/home/me/step.py", line {line} in step\n'
            '  File "/work/labkit/_zygote.py", line 214 in _run_job\n')


def job(*ranks: RankResult) -> JobResult:
    return JobResult(world_size=len(ranks), backend="gloo", ranks=list(ranks))


def raised(rank, error, traceback="", t=1.0):
    return RankResult(rank, "raised", error=error, traceback=traceback, t_fail=t)


def hung(rank, line, op):
    return RankResult(rank, "hung", stack=stack(line, op))


# ------------------------------------------------------------------ failed jobs
def test_a_rank_stuck_in_its_own_code_is_the_culprit():
    v = diagnose(job(raised(0, TIMEOUT, tb(5, "dist.all_reduce(t)", "all_reduce")),
                     hung(1, 4, None)))
    assert (v.kind, v.culprits, v.collective) == ("missing_rank", [1], "all_reduce")
    assert "outside any collective" in v.cause and "load" in v.where[1]
    assert v.ranks[0].state == "timed out" and v.ranks[1].state == "hung"


def test_a_rank_that_returned_skipped_the_collective():
    v = diagnose(job(raised(0, TIMEOUT, tb(5, "dist.all_reduce(t)", "all_reduce")),
                     RankResult(1, "ok", value=1.0)))
    assert (v.kind, v.culprits) == ("missing_rank", [1])
    assert "returned normally" in v.cause and "uneven inputs" in v.cause


def test_the_earliest_collective_is_the_one_missed():
    # Real mystery run: a broadcast's non-root ranks passed it and wait in the next all_reduce.
    v = diagnose(job(hung(0, 10, "broadcast"), hung(1, 11, "all_reduce"), hung(2, 8, None),
                     hung(3, 11, "all_reduce")))
    assert (v.kind, v.culprits, v.collective) == ("missing_rank", [2], "broadcast")
    assert "later collective" in " ".join(v.details)


def test_different_collectives_with_a_timeout_and_an_echo_are_a_mismatch():
    # rank 0 timed out in all_reduce and left; rank 1, waiting in broadcast, saw it go
    v = diagnose(job(raised(0, TIMEOUT, tb(5, "dist.all_reduce(t)", "all_reduce")),
                     raised(1, RESET, tb(7, "dist.broadcast(t, 0)", "broadcast"), t=1.1)))
    assert (v.kind, v.collective) == ("mismatch", "all_reduce vs broadcast")


DETAIL_0 = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
            "collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4],"
            " TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device="
            "cpu)), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=2OpType="
            "GATHER).Collectives differ in the following aspects:   Op type: ALLREDUCEvs GATHER")
DETAIL_1 = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running "
            "collective: CollectiveFingerPrint(SequenceNumber=2OpType=BARRIER), but Rank 0 is "
            "running collective: CollectiveFingerPrint(SequenceNumber=2OpType=REDUCE).")


def test_detail_mismatch_trusts_each_ranks_own_fingerprint():
    # The real texts: what a rank says about its peer can be garbled (GATHER, REDUCE).
    v = diagnose(job(raised(0, DETAIL_0), raised(1, DETAIL_1)))
    assert (v.kind, v.seq, v.collective, v.culprits) == ("mismatch", 2, "all_reduce vs barrier",
                                                         [0, 1])


def test_detail_size_mismatch():
    msg = ("RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running "
           "collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[{n}]"
           ", TensorDtypes=Float, TensorDeviceTypes=x)")
    v = diagnose(job(raised(0, msg.format(r=0, n=4)), raised(1, msg.format(r=1, n=5))))
    assert (v.kind, v.collective, v.seq) == ("size_mismatch", "all_reduce", 0)
    assert "[4]" in v.headline and "[5]" in v.headline


def test_monitored_barrier_names_the_missing_ranks():
    v = diagnose(job(raised(0, "RuntimeError: [Rank 0]: Ranks 2, 3 failed to pass monitoredBarrier "
                               "in 2000 ms"),
                     raised(1, "RuntimeError: Rank 1 successfully reached monitoredBarrier, but "
                               "received errors while waiting for send/recv from rank 0."),
                     hung(2, 3, None), hung(3, 3, None)))
    assert (v.kind, v.culprits, v.collective) == ("missing_rank", [2, 3], "monitored_barrier")
    assert v.ranks[1].state == "echo"


def test_a_sigabrt_with_gloo_size_message_is_a_size_mismatch():
    err = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
           "[enforce fail at /gloo/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. "
           "Received data size doesn't match expected size.\nFatal Python error: Aborted\n\n"
           + stack(4, "all_reduce"))
    v = diagnose(job(RankResult(0, "signaled", signal="SIGABRT", stderr=err, t_fail=1.0),
                     raised(1, RESET, tb(4, "dist.all_reduce(t)", "all_reduce"), t=1.01)))
    assert (v.kind, v.culprits, v.collective) == ("size_mismatch", [0], "all_reduce")
    assert "Rank 1 only saw the connection drop" in v.cause


def test_a_crash_comes_before_its_echoes():
    v = diagnose(job(raised(0, RESET, t=1.01), RankResult(1, "exited", exitcode=3, t_fail=1.0),
                     raised(2, RESET, t=1.02)))
    assert (v.kind, v.culprits) == ("crash", [1])
    assert [f.state for f in v.ranks] == ["echo", "crashed", "echo"]


def test_ddp_detail_segfault_is_named():
    err = ('Fatal Python error: Segmentation fault\n'
           '  File "x/distributed.py", line 1 in _ddp_init_helper')
    v = diagnose(job(RankResult(0, "signaled", signal="SIGSEGV", stderr=err)))
    assert v.kind == "crash" and "DETAIL" in v.cause and "INFO" in v.fix


def test_an_exception_in_one_rank_is_the_error():
    v = diagnose(job(raised(0, RESET, t=1.1),
                     raised(1, "ValueError: corrupt batch on rank 1",
                            'Traceback (most recent call last):\n  File "/home/me/s.py", line 3, '
                            'in step\n    raise ValueError("corrupt batch")\n')))
    assert (v.kind, v.culprits) == ("error", [1])
    assert "line 3" in v.where[1] and "Rank 0 failed only because of it" in v.cause


def test_unused_parameters_names_them():
    err = ("RuntimeError: Expected to have finished reduction in the prior iteration before "
           "starting a new one.\nParameters which did not receive grad for rank 0: aux.bias, "
           "aux.weight\nParameter indices which did not receive grad for rank 0: 4 5")
    v = diagnose(job(raised(0, err), raised(1, err)))
    assert v.kind == "unused_parameters" and "aux.bias, aux.weight" in v.headline
    assert "find_unused_parameters=True" in v.fix


def test_diagnose_takes_the_error_and_rejects_other_things():
    res = job(raised(0, "ValueError: x"), RankResult(1, "ok", value=1))
    assert diagnose(lk.RankError("boom", res)).kind == "error"
    with pytest.raises(TypeError, match="JobResult"):
        diagnose("not a result")


def test_tb_frames_are_innermost_first():
    frames = tb_frames(tb(5, "dist.all_reduce(t)", "all_reduce"))
    assert [f.func for f in frames] == ["all_reduce", "wrapper", "step"]


def test_verdict_prints_everything_a_learner_needs():
    v = Verdict("missing_rank", "rank 1 never reached all_reduce", [1], "all_reduce", 3,
                "it was late", "call it everywhere")
    text = str(v)
    for part in ("missing_rank", "all_reduce (sequence number 3", "Cause: it was late",
                 "Fix: call it everywhere"):
        assert part in text
    assert not v.ok and Verdict("ok", "fine").ok


# ------------------------------------------------------------------ evidence from ranks
def fp(rank, **sums):
    names = tuple(sums)
    return Fingerprint(rank, names, tuple("buffer" if n.startswith("running") else "param"
                                          for n in names), tuple(sums.values()))


def test_fingerprints_agree_or_name_what_differs():
    same = [fp(r, w=(1.0, 2.0, 3.0), running_mean=(0.5, 0.1, 0.7)) for r in range(3)]
    assert compare_fingerprints(same).ok
    bn = same[:2] + [fp(2, w=(1.0, 2.0, 3.0), running_mean=(0.6, 0.1, 0.7))]
    v = compare_fingerprints(bn)
    assert (v.kind, v.culprits) == ("replicas_diverged", [2])
    assert "only buffers differ" in v.cause and "running_mean" in v.details[0]
    w = [fp(0, w=(1.0, 2.0, 3.0)), fp(1, w=(1.0, 2.0, 3.0 + 1e-6))]
    v = compare_fingerprints(w)
    assert v.kind == "replicas_diverged" and "gradient" in v.cause


def test_diagnose_compares_fingerprints_returned_inside_values():
    res = job(RankResult(0, "ok", value={"loss": 1.0, "fp": fp(0, w=(1.0, 0.0, 0.0))}),
              RankResult(1, "ok", value={"loss": 1.0, "fp": fp(1, w=(2.0, 0.0, 0.0))}))
    assert diagnose(res).kind == "replicas_diverged"
    assert diagnose(job(RankResult(0, "ok", value=1), RankResult(1, "ok", value=1))).ok


def test_flight_records_name_the_rank_and_sequence_number():
    ahead = FlightRecord(0, ((1, "all_reduce", ((4,),)), (2, "broadcast", ((4,),)),
                             (3, "all_reduce", ((4,),))), 3, "RuntimeError: Timed out")
    behind = FlightRecord(1, ((1, "all_reduce", ((4,),)), (2, "broadcast", ((4,),))), 2)
    v = compare_flight_records([ahead, behind])
    assert (v.kind, v.culprits, v.seq, v.collective) == ("missing_rank", [1], 3, "all_reduce")
    other = FlightRecord(1, ((1, "all_reduce", ()), (2, "barrier", ())), 2)
    v = compare_flight_records([ahead, other])
    assert (v.kind, v.seq) == ("mismatch", 2)
    assert compare_flight_records([behind, behind]).ok


def test_shard_logs_catch_duplicates_and_a_missing_set_epoch():
    full = tuple(range(8))
    assert compare_shards([ShardLog(r, (full, full[::-1]), 8) for r in range(2)]).kind == \
        "data_sharding"
    same_order = [ShardLog(0, ((0, 2), (0, 2)), 4), ShardLog(1, ((1, 3), (1, 3)), 4)]
    v = compare_shards(same_order)
    assert v.kind == "data_sharding" and "set_epoch" in v.fix
    good = [ShardLog(0, ((0, 2), (2, 1)), 4), ShardLog(1, ((1, 3), (3, 0)), 4)]
    assert compare_shards(good).ok


# ------------------------------------------------------------------ inside a real job
def _replica_job(rank, world_size, perturb):
    from labkit.diagnosis import check_replicas, fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    if perturb and rank == world_size - 1:
        with torch.no_grad():
            model[1].running_var += 1.0
    v = check_replicas(model)
    return v.kind, v.culprits, fingerprint(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_check_replicas_inside_a_job_agrees_on_every_rank(world_size):
    ok = lk.run(_replica_job, world_size, args=(False,), timeout=5, echo=False).values
    assert all(v[:2] == ("ok", []) for v in ok)
    bad = lk.run(_replica_job, world_size, args=(True,), timeout=5, echo=False).values
    assert all(v[:2] == ("replicas_diverged", [world_size - 1]) for v in bad)
    # and the notebook-side comparison of the returned fingerprints says the same
    assert compare_fingerprints([v[2] for v in bad]).culprits == [world_size - 1]
    lk.shutdown()  # warm ranks stay after a job that succeeded; shutdown ends them
    assert_no_ranks_left()


def test_nccl_watchdog_text_names_the_collective_and_the_rank_that_never_came():
    # Format of ProcessGroupNCCL's watchdog message (not captured here: no GPUs on this machine).
    err = ("[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
           "timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, Timeout(ms)=5000) "
           "ran for 5003 milliseconds before timing out.\nFatal Python error: Aborted\n")
    v = diagnose(job(RankResult(0, "signaled", signal="SIGABRT", stderr=err),
                     RankResult(1, "ok", value=[1.0])))
    assert (v.kind, v.culprits, v.collective, v.seq) == ("missing_rank", [1], "all_reduce", 1)
    assert "watchdog" in v.cause
