"""DDP that overlaps communication with backward, in buckets (notebook 02, "Use it").

:class:`BucketedDDP` registers a hook on every parameter that fires as soon as its gradient is
ready *during* backward; gradients are packed into buckets of about ``bucket_cap_mb`` and each
full bucket starts an asynchronous ``all_reduce`` while backward keeps computing the earlier
layers. ``bucket_cap_mb=0`` gives one bucket per parameter (overlap without bucketing); a huge
cap gives one bucket (bucketing without overlap). Compare :mod:`labkit.ddp.naive`, which it
extends, and torch's own DDP, whose buckets differ (see the class docstring).

Example (inside a rank of ``lk.run``)::

    model = BucketedDDP(make_model().to(device()), bucket_cap_mb=1)
    loss = loss_fn(model(x), y)
    loss.backward()                       # all-reduces start in here
    model.finish_gradient_synchronization()
    opt.step()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..common.timeline import Timeline, now
from ..grading.references import reference
from .naive import ReplicatedModule

__all__ = ["assign_buckets", "BucketedDDP"]


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


class BucketedDDP(ReplicatedModule):
    """Data parallelism that overlaps communication with backward, in buckets.

    Args:
        module: the model, already on :func:`~labkit.common.ranks.device`.
        bucket_cap_mb: bucket size in megabytes; 0 = one bucket per parameter.
        group: process group (default: the whole world).
        timeline: a :class:`~labkit.common.timeline.Timeline` to record each bucket's
            all-reduce (lane ``"comm"``, from launch to completion) and when
            its gradients were ready.

    Buckets are filled in reverse parameter order (roughly the order in which
    backward produces gradients) and always launched in bucket order, so every
    rank issues the same collectives in the same order even if hooks fire in
    a different order. A bucket whose parameter got no gradient this step is
    launched by :meth:`finish_gradient_synchronization`.

    Unused parameters, as torch's ``DistributedDataParallel(find_unused_parameters=True)``
    treats them (torch 2.13, tests/ddp/): each rank notes which parameters got a gradient
    since the last synchronisation (micro-batches under :meth:`no_sync` included), and one
    more small all-reduce adds up these notes. A parameter that **no rank** used keeps its
    ``.grad`` untouched (``None`` stays ``None``, so a momentum optimizer leaves it alone);
    one that **some** ranks used gets the average over all ranks, a rank that did not use it
    contributing what its ``.grad`` holds (zeros when it is ``None``). Frozen parameters
    (``requires_grad=False``) are never touched.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None,
                 timeline: Timeline | None = None, broadcast_buffers: bool = True) -> None:
        super().__init__(module, group, broadcast_buffers)
        self.timeline, self.bucket_cap_mb = timeline, bucket_cap_mb
        self.world_size = dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        groups = assign_buckets([p.numel() * p.element_size() for p in params], bucket_cap_mb,
                                keys=[(p.dtype, p.device) for p in params])
        self._buckets = [_Bucket([params[i] for i in idx]) for idx in groups]
        self._where = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket.params}
        self._order = {id(p): i for i, p in enumerate(params)}   # index into the used map
        self._used: set[int] = set()          # got a gradient since the last synchronisation
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names in each bucket, in launch order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self._buckets]

    def _grad_ready(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
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

    @reference
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

    def _launch_used_map(self):
        """All-reduce how many ranks used each parameter (async; after the buckets, everywhere)."""
        flags = torch.zeros(len(self._order), dtype=torch.int32,
                            device=self._buckets[0].buffer.device)
        for pid in self._used:
            flags[self._order[pid]] = 1
        return flags, dist.all_reduce(flags, group=self.group, async_op=True)

    @reference
    def finish_gradient_synchronization(self) -> None:
        """Launch any bucket still waiting, wait for all, and write the averages into ``.grad``.

        A parameter no rank used keeps its ``.grad`` as it is (see the class docstring).
        """
        if not self._sync:
            return
        if not self._buckets:
            return
        while self._next < len(self._buckets):  # unused parameters: launch in bucket order
            self._launch(self._next)
        used, used_work = self._launch_used_map()
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
                    offset += p.numel()
                    if id(p) not in self._used:       # not here: was it used anywhere?
                        if used_work is not None:
                            used_work.wait()
                            used_work = None
                        if int(used[self._order[id(p)]]) == 0:
                            continue                  # unused on every rank: leave .grad alone
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
            bucket.ready.clear()
            bucket.work = None
        if used_work is not None:
            used_work.wait()
        self._used.clear()
        self._next = 0

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the module (before wrapping it again, say)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
