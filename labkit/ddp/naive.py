"""DDP from scratch, the simple way: replicate, then average every gradient after backward.

Notebook 02 ("Step 1 · Replicate" to "Step 6"; the learner writes step 5) builds data-parallel
training by hand in two versions, this one first and :mod:`labkit.ddp.bucketed` next, so the
difference is the lesson:

* :func:`broadcast_parameters` — step 1, every rank starts from rank 0's parameters and buffers;
* :func:`average_gradients` — step 5, one blocking ``all_reduce`` per gradient, divided by N;
* :class:`NaiveDDP` — both in a wrapper: every gradient byte is communicated after all the
  compute.

Tested against ``torch.nn.parallel.DistributedDataParallel`` and a single-process run on the
whole batch (tests/ddp/). Works with gloo (CPU) and NCCL (tensors on ``device()``).

Example (inside a rank of ``lk.run``)::

    model = NaiveDDP(make_model().to(device()))
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    opt.step()
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..common.ranks import require_process_group
from ..grading.references import reference

__all__ = ["broadcast_parameters", "average_gradients", "ReplicatedModule", "NaiveDDP"]


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Step 1, replicate: copy rank ``src``'s parameters and buffers into every rank."""
    require_process_group("broadcast_parameters")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


@reference
def average_gradients(module: nn.Module, group=None) -> int:
    """Step 5 the simple way: all-reduce every gradient (sum) and divide by the world size.

    Parameters without a gradient (frozen, or unused this step) are skipped; a
    tied weight is one parameter and is reduced once. Returns the number of
    ``all_reduce`` calls made. Skipping is right for a parameter that no rank used; one
    used on some ranks only would make the ranks issue different all-reduces: that takes
    :class:`~labkit.ddp.bucketed.BucketedDDP`'s bookkeeping (or torch DDP's
    ``find_unused_parameters=True``).
    """
    require_process_group("average_gradients")
    world_size = dist.get_world_size(group)
    calls = 0
    for p in module.parameters():           # unique parameters: tied weights appear once
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        p.grad.div_(world_size)
        calls += 1
    return calls


class ReplicatedModule(nn.Module):
    """What both hand-written DDPs share: one replica per rank, identical from the start
    (broadcast from rank 0), and a switch to skip synchronisation for accumulation.

    With ``broadcast_buffers=True`` (torch DDP's default) a forward first copies rank 0's
    buffers (BatchNorm's running statistics, say) into every rank when the forward before it
    ran with gradients enabled and outside :meth:`no_sync` (and the first forward always),
    as ``torch.nn.parallel.DistributedDataParallel`` does in torch 2.13
    (tests/ddp/test_torch_ddp_semantics.py).
    """

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        require_process_group(type(self).__name__)
        self.module, self.group = module, group
        self.broadcast_buffers = broadcast_buffers
        self.allreduce_calls = 0
        self._sync = True
        self._sync_buffers_next = True
        broadcast_parameters(module, group=group)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=0, group=self.group)
        out = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and self._sync
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation's micro-batches): no gradient is
        communicated until the block ends (buffers still are, before each forward)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old


class NaiveDDP(ReplicatedModule):
    """Data parallelism in its simplest form: broadcast once, average every gradient after backward.

    Args:
        module: the model, already on :func:`~labkit.common.ranks.device`.
        group: process group (default: the whole world).
        broadcast_buffers: copy rank 0's buffers into every rank before each forward.

    Call :meth:`finish_gradient_synchronization` after ``loss.backward()`` and
    before ``optimizer.step()``. ``allreduce_calls`` counts the gradient all-reduces.
    """

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True) -> None:
        super().__init__(module, group, broadcast_buffers)

    @reference
    def finish_gradient_synchronization(self) -> None:
        """All-reduce and average every gradient (skipped inside :meth:`no_sync`)."""
        if self._sync:
            self.allreduce_calls += average_gradients(self.module, self.group)
