"""DDP launched by torchrun: the script reads its rank from the environment.

Run it:  torchrun --standalone --nproc-per-node=2 -m labkit.torchrun.ddp_torchrun
(or ``python -m torch.distributed.run`` instead of ``torchrun``). torchrun
starts the ranks, sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
restarts them on failure (--max-restarts) and spans nodes (--nnodes).
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labkit.portable.ending import run_then_exit
from labkit.torchrun.train import make_dataset, make_model


def train(rank, world_size, device, epochs=2, batch_size=64):
    data = make_dataset()
    model = DDP(make_model(dropout=0.0).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size // world_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        total = sum(p.double().sum().item() for p in model.module.parameters())
        print(f"parameter checksum {total:.12f}", flush=True)


@record                                           # tracebacks into torchrun's error summary
def main():
    rank = int(os.environ["RANK"])                # all set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])    # the GPU index on this node
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")   # reads MASTER_ADDR/PORT, RANK ...
    try:
        train(rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)   # main(), then leave without the interpreter's teardown (ending.py)
