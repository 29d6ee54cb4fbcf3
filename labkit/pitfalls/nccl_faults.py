"""Three real NCCL failures, run under torchrun, to see (and capture) what NCCL prints.

    torchrun --standalone --nproc-per-node=2 -m labkit.pitfalls.nccl_faults skipped --timeout 5

``python -m labkit nccl-capture`` runs each one that fits the machine's GPUs
with ``NCCL_DEBUG=INFO`` and the flight recorder on, and stores the logs that
notebook 04 §9 shows on machines without GPUs.

skipped      (2 GPUs) rank 1 skips the third all_reduce, as in notebook 04 §2. On NCCL the
             call only enqueues work, so rank 0 blocks reading the result until the
             watchdog's timeout; the watchdog then dumps the flight recorder and tears
             the process down.
busy_gpu     (1 GPU, one rank) the all_reduce waits behind a long GPU kernel. The watchdog
             cannot tell "the GPU is busy" from "a peer never came": it reports the same
             timeout. This one runs on a single GPU.
same_device  (1 GPU, two ranks) every rank picks cuda:0 because the script forgot
             LOCAL_RANK; NCCL refuses two ranks of one communicator on one GPU.

``--backend gloo`` runs ``skipped`` on the CPU (to try the script without GPUs).
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

SCENARIOS = {"skipped": 2, "busy_gpu": 1, "same_device": 2}   # name -> world size
GPUS_NEEDED = {"skipped": 2, "busy_gpu": 1, "same_device": 1}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--timeout", type=float, default=5.0, help="process-group timeout, seconds")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    args = p.parse_args(argv)
    if args.backend == "gloo" and args.scenario != "skipped":
        p.error(f"{args.scenario} is a GPU scenario: run it with --backend nccl")

    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.backend == "nccl":
        # BUG in same_device: every rank takes GPU 0 (the fix: torch.device("cuda", local_rank))
        device = torch.device("cuda", 0 if args.scenario == "same_device" else local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    print(f"rank {rank}: process group up on {device} ({args.backend})", flush=True)

    t = torch.ones(4, device=device)
    if args.scenario == "skipped":
        for n in (1, 2, 3):
            if n == 3 and rank == 1:
                continue                  # BUG: collective #3 is skipped on rank 1
            dist.all_reduce(t)
            print(f"rank {rank}: all_reduce #{n} issued", flush=True)
    elif args.scenario == "busy_gpu":
        dist.all_reduce(t)                # #1 completes
        torch.cuda._sleep(int(2e9 * (args.timeout + 60)))   # ~a minute of GPU work, same stream
        dist.all_reduce(t)                # #2 is queued behind it
        print(f"rank {rank}: all_reduce #2 issued behind a long kernel", flush=True)
    else:
        dist.all_reduce(t)
    print(f"rank {rank}: result {t.tolist()}", flush=True)   # .tolist() waits for the GPU
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
