"""DDP where the script starts its own ranks with mp.spawn (one machine only).

Run it:  python -m labkit.torchrun.ddp_spawn
Notebook 05 diffs this file against ddp_torchrun.py: that diff is the whole
move from mp.spawn to torchrun.
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labkit.portable.ending import exit_now
from labkit.torchrun.train import make_dataset, make_model

WORLD_SIZE = 2


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


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"       # the rendezvous: we pick it ourselves
    os.environ["MASTER_PORT"] = str(port)
    cuda = torch.cuda.device_count() >= world_size
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, device)
    finally:
        dist.destroy_process_group()
    exit_now()        # leave without the interpreter's teardown: portable/ending.py says why


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(WORLD_SIZE, free_port()), nprocs=WORLD_SIZE)
