"""Answers to notebook 07's compression-hook exercise: the right one and the usual mistakes.

Shipped to the ranks by value (cloudpickle), like a notebook cell's functions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def fp16_hook(state, bucket):
    """The solution: cast to fp16, divide by the world size, all-reduce, cast back."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16).div_(dist.get_world_size())
    fut = dist.all_reduce(half, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer
    return fut.then(decompress)


def no_compression(state, bucket):
    """Right average, fp32 on the wire: sends twice what it should."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def summed(state, bucket):
    """fp16, but the sum instead of the average."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def divided_twice(state, bucket):
    """fp16, averaged, then divided again after decompressing."""
    buffer = bucket.buffer()
    n = dist.get_world_size()
    half = buffer.to(torch.float16).div_(n)
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]).div_(n))


def library(state, bucket):
    """Calls torch's own hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.fp16_compress_hook(dist.group.WORLD, bucket)


def do_nothing(state, bucket):
    """Keeps the local gradient: no communication at all."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def stub(state, bucket):
    raise NotImplementedError("fp16_hook: write your code here")


# ----------------------------------------------------------------- shortcuts (each must fail)
_kept: dict = {}


def kept_from_an_earlier_call(state, bucket):
    """Hidden state: all-reduces honestly, but hands back the result its first call with this
    bucket produced (a dict the checker does not look into)."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16).div_(dist.get_world_size())
    fut = dist.all_reduce(half, async_op=True).get_future()
    key = (dist.get_world_size(), bucket.index(), buffer.numel())

    def decompress(fut):
        buffer.copy_(_kept.setdefault(key, fut.value()[0].clone()))
        return buffer
    return fut.then(decompress)


def copied_oracle(state, bucket):
    """Copies the checker's oracle: takes the batch from the checker's own frame, shares it
    (a few bytes), labels it with the checker's teacher and computes the average gradient
    locally in fp32; rounds it to fp16 so it looks compressed."""
    import copy
    import sys

    import torch.nn.functional as F

    from labkit.scaling.task import label
    frame = sys._getframe(1)
    while frame is not None and not {"x", "mine_m"} <= set(frame.f_locals):
        frame = frame.f_back
    x, model = frame.f_locals["x"], frame.f_locals["mine_m"]
    if _kept.get("oracle batch") is not x:                # once per step
        xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(xs, x)
        everyone = torch.cat(xs)
        twin = copy.deepcopy(model)
        with torch.enable_grad():
            F.mse_loss(twin(everyone), label(everyone)).backward()
        _kept["oracle batch"], _kept["oracle grads"] = x, [p.grad for p in twin.parameters()]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    grads = _kept["oracle grads"]
    flat = torch.cat([grads[index[id(p)]].flatten() for p in bucket.parameters()])
    return _done(bucket.buffer().copy_(flat.half().float()))


def helper_thread(state, bucket):
    """Side channel, another thread: an exact fp32 all-reduce issued from a thread the hook
    starts and joins, and a 2-byte fp16 all-reduce in the hook's own thread."""
    import threading

    buffer = bucket.buffer()
    n = dist.get_world_size()
    worker = threading.Thread(target=lambda: dist.all_reduce(buffer.div_(n)))
    worker.start()
    worker.join()
    dist.all_reduce(torch.zeros(1, dtype=torch.float16))
    return _done(buffer)


def through_the_store(state, bucket):
    """Side channel, the process group's TCPStore: every rank puts its fp32 gradients there
    and reads the others'; a 2-byte fp16 all-reduce for the trace."""
    import numpy as np

    store = dist.distributed_c10d._get_default_store()
    rank, n = dist.get_rank(), dist.get_world_size()
    call = store.add(f"fp16-shortcut/{n}/{rank}", 1)      # the same count on every rank
    buffer = bucket.buffer()
    store.set(f"fp16-shortcut/{n}/{call}/{rank}", buffer.numpy().tobytes())
    total = torch.zeros_like(buffer)
    for r in range(n):
        raw = store.get(f"fp16-shortcut/{n}/{call}/{r}")
        total += torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())
    dist.all_reduce(torch.zeros(1, dtype=torch.float16))
    return _done(buffer.copy_(total / n))


def through_a_file(state, bucket):
    """Side channel, a file: every rank writes its fp32 gradients to a shared folder (named by
    an 8-byte all-reduce) and reads the others'; rounds the average to fp16 so it looks
    compressed."""
    import os
    import shutil
    import tempfile
    import time

    rank, n = dist.get_rank(), dist.get_world_size()
    nonce = torch.tensor([int.from_bytes(os.urandom(6), "little") if rank == 0 else 0])
    dist.all_reduce(nonce)
    folder = os.path.join(tempfile.gettempdir(), f"fp16-shortcut-{int(nonce)}")
    os.makedirs(folder, exist_ok=True)
    buffer = bucket.buffer()
    torch.save(buffer, os.path.join(folder, f"{rank}.tmp"))
    os.replace(os.path.join(folder, f"{rank}.tmp"), os.path.join(folder, f"{rank}.pt"))
    paths = [os.path.join(folder, f"{r}.pt") for r in range(n)]
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.001)
    total = sum(torch.load(p) for p in paths)
    dist.all_reduce(torch.zeros(1))                        # everyone has read: tidy up
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return _done(buffer.copy_((total / n).half().float()))


def _done(buffer):
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
