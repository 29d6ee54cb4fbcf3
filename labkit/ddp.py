"""DDP from scratch: replicate, average the gradients, then overlap and bucket the all-reduces.

Notebook 02 builds data-parallel training in two versions, placed one after
the other so the difference is the lesson:

* :class:`NaiveDDP` waits for ``loss.backward()`` to finish, then issues one
  blocking ``all_reduce`` per parameter and divides by the world size. Simple,
  correct, and every byte of communication happens after all the compute.
* :class:`BucketedDDP` registers a hook on every parameter that fires as soon
  as its gradient is ready *during* backward; gradients are packed into
  buckets of about ``bucket_cap_mb`` and each full bucket starts an
  asynchronous ``all_reduce`` while backward keeps computing the earlier
  layers. ``bucket_cap_mb=0`` gives one bucket per parameter (overlap without
  bucketing); a huge cap gives one bucket (bucketing without overlap).

Both broadcast rank 0's parameters and buffers at construction (step 1,
"replicate") and are tested against ``torch.nn.parallel.DistributedDataParallel``
and a single-process run on the whole batch (tests/test_ddp.py). Both work
with gloo (CPU) and NCCL (tensors on ``device()``).

Example (inside a rank of ``lk.run``)::

    model = BucketedDDP(make_model().to(device()), bucket_cap_mb=1)
    loss = loss_fn(model(x), y)
    loss.backward()                       # all-reduces start in here
    model.finish_gradient_synchronization()
    opt.step()
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .timeline import Timeline, now

__all__ = ["device", "broadcast_parameters", "average_gradients", "assign_buckets",
           "NaiveDDP", "BucketedDDP", "checksum"]


def device() -> torch.device:
    """This rank's device: ``cuda:<rank>`` when the process group is NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _require_process_group(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised, and here it is not (this is the "
            f"notebook's own process, not a rank). Call it inside a function you run with "
            f"lk.run(fn, world_size=...), or after dist.init_process_group() under torchrun.")


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Step 1, replicate: copy rank ``src``'s parameters and buffers into every rank."""
    _require_process_group("broadcast_parameters")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def average_gradients(module: nn.Module, group=None) -> int:
    """Step 5 the simple way: all-reduce every gradient (sum) and divide by the world size.

    Parameters without a gradient (frozen, or unused this step) are skipped; a
    tied weight is one parameter and is reduced once. Returns the number of
    ``all_reduce`` calls made.
    """
    _require_process_group("average_gradients")
    world_size = dist.get_world_size(group)
    calls = 0
    for p in module.parameters():           # unique parameters: tied weights appear once
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        p.grad.div_(world_size)
        calls += 1
    return calls


def checksum(module: nn.Module) -> float:
    """Sum of every parameter, in float64: equal checksums across ranks = replicas agree."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in module.parameters()))


def assign_buckets(sizes_bytes: list[int], bucket_cap_mb: float,
                   keys: list | None = None) -> list[list[int]]:
    """Group tensors (given in the order their gradients become ready) into buckets.

    A bucket closes once it holds at least ``bucket_cap_mb`` megabytes (2**20
    bytes), like torch DDP's ``bucket_cap_mb``; a change of ``keys`` (dtype,
    device) also starts a new bucket, since one bucket is one flat tensor.

    >>> assign_buckets([400_000, 400_000, 400_000], bucket_cap_mb=0.5)
    [[0, 1], [2]]
    >>> assign_buckets([8, 8, 8], bucket_cap_mb=0)
    [[0], [1], [2]]
    """
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 megabytes, got {bucket_cap_mb!r}.")
    cap = bucket_cap_mb * 2**20
    buckets: list[list[int]] = []
    filled = 0.0
    for i, size in enumerate(sizes_bytes):
        new_key = keys is not None and buckets and keys[buckets[-1][-1]] != keys[i]
        if not buckets or filled >= cap or new_key:
            buckets.append([])
            filled = 0.0
        buckets[-1].append(i)
        filled += size
    return buckets


class _Replicas(nn.Module):
    """What both hand-written DDPs share: one replica per rank, identical from the start
    (broadcast from rank 0), and a switch to skip synchronisation for accumulation."""

    def __init__(self, module: nn.Module, group=None) -> None:
        super().__init__()
        _require_process_group(type(self).__name__)
        self.module, self.group = module, group
        self.allreduce_calls = 0
        self._sync = True
        broadcast_parameters(module, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation's micro-batches): nothing is
        communicated until the block ends."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old


class NaiveDDP(_Replicas):
    """Data parallelism in its simplest form: broadcast once, average every gradient after backward.

    Args:
        module: the model, already on :func:`device`.
        group: process group (default: the whole world).

    Call :meth:`finish_gradient_synchronization` after ``loss.backward()`` and
    before ``optimizer.step()``. ``allreduce_calls`` counts the collectives.
    """

    def __init__(self, module: nn.Module, group=None) -> None:
        super().__init__(module, group)

    def finish_gradient_synchronization(self) -> None:
        """All-reduce and average every gradient (skipped inside :meth:`no_sync`)."""
        if self._sync:
            self.allreduce_calls += average_gradients(self.module, self.group)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.ready: set[int] = set()
        self.work = None
        self.launched_at = 0.0
        self.done_at: list[float] = []

    def is_full(self) -> bool:
        """Every parameter of the bucket has its gradient for this backward."""
        return len(self.ready) == len(self.params)


class BucketedDDP(_Replicas):
    """Data parallelism that overlaps communication with backward, in buckets.

    Args:
        module: the model, already on :func:`device`.
        bucket_cap_mb: bucket size in megabytes; 0 = one bucket per parameter.
        group: process group (default: the whole world).
        timeline: a :class:`~labkit.timeline.Timeline` to record each bucket's
            all-reduce (lane ``"comm"``, from launch to completion) and when
            its gradients were ready.

    Buckets are filled in reverse parameter order (roughly the order in which
    backward produces gradients) and always launched in bucket order, so every
    rank issues the same collectives in the same order even if hooks fire in
    a different order. A bucket whose parameter got no gradient this step is
    launched by :meth:`finish_gradient_synchronization` (missing gradients
    count as zeros).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None,
                 timeline: Timeline | None = None) -> None:
        super().__init__(module, group)
        self.timeline, self.bucket_cap_mb = timeline, bucket_cap_mb
        self.world_size = dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        groups = assign_buckets([p.numel() * p.element_size() for p in params], bucket_cap_mb,
                                keys=[(p.dtype, p.device) for p in params])
        self._buckets = [_Bucket([params[i] for i in idx]) for idx in groups]
        self._where = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket.params}
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names in each bucket, in launch order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self._buckets]

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        b = self._where[id(param)]
        bucket = self._buckets[b]
        bucket.ready.add(id(param))
        if self.timeline is not None and bucket.is_full():
            t = now()
            self.timeline.add("grads ready", t, t, lane="comm", label=f"b{b}")
        while self._next < len(self._buckets) and self._buckets[self._next].is_full():
            self._launch(self._next)             # strictly in bucket order, on every rank

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        offset = 0
        with torch.no_grad():
            for p in bucket.params:
                view = bucket.buffer[offset:offset + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
                offset += p.numel()
            bucket.buffer.div_(self.world_size)
        bucket.launched_at = now()
        bucket.done_at = []
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        if self.timeline is not None and bucket.buffer.device.type == "cpu":
            done = bucket.done_at
            bucket.work.get_future().then(lambda fut: done.append(now()))
        self.allreduce_calls += 1
        self._next = b + 1

    def finish_gradient_synchronization(self) -> None:
        """Launch any bucket still waiting, wait for all, and write the averages into ``.grad``."""
        if not self._sync:
            return
        while self._next < len(self._buckets):  # unused parameters: launch in bucket order
            self._launch(self._next)
        for b, bucket in enumerate(self._buckets):
            bucket.work.wait()
            waited = now()
            if self.timeline is not None:
                end = bucket.done_at[0] if bucket.done_at else waited
                self.timeline.add("all_reduce", bucket.launched_at, end, lane="comm",
                                  label=f"b{b}")
            offset = 0
            with torch.no_grad():
                for p in bucket.params:
                    avg = bucket.buffer[offset:offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
                    offset += p.numel()
            bucket.ready.clear()
            bucket.work = None
        self._next = 0

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the module (before wrapping it again, say)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
