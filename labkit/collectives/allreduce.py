"""All-reduce written by hand: the naive master approach, then the chunked ring (notebook 03).

``dist.all_reduce`` leaves the elementwise sum of every rank's tensor on every rank. Two
ways to build it from point-to-point messages:

* :func:`naive_all_reduce` — every rank sends its whole tensor to rank 0, which adds them
  up and sends the result back: rank 0 moves (N-1)·S bytes each way, one peer at a time.
* :func:`ring_all_reduce` — split the tensor into N chunks; N-1 steps of *reduce-scatter*
  (pass a chunk to the right neighbour, add the one from the left) leave each rank with one
  fully reduced chunk; N-1 steps of *all-gather* pass the reduced chunks around. Every rank
  sends 2(N-1)/N·S bytes, however many ranks there are.

Both work in place and return the tensor, like ``dist.all_reduce`` (``op="sum"`` or
``"mean"``), on gloo and NCCL, for any shape, dtype and length (even shorter than N).
With ``trace=RankTrace(...)`` they record every chunk sent and received (a chunk of 8 MiB or
more goes in pieces: one record still) and every chunk's value after each step
(:mod:`labkit.collectives.trace`); :func:`record` runs one on real ranks and returns the
merged :class:`~labkit.collectives.trace.Trace`. The exercise checker and the quiz keys are
in :mod:`labkit.collectives.check`.

Example::

    def step(rank, world_size):
        t = torch.arange(10.0) * (rank + 1)
        return lk.collectives.ring_all_reduce(t)

    lk.run(step, world_size=3).values[0]      # == torch.arange(10.0) * 6
"""
from __future__ import annotations

from typing import Any, Callable

from ..runtime import run
from ..grading.references import reference
from .trace import RankTrace, Trace, now, tracing

__all__ = ["ring_all_reduce", "naive_all_reduce", "send_right_recv_left", "ring_schedule",
           "expected_traffic", "ring_bytes_per_rank", "naive_master_bytes", "check_traffic",
           "record", "powers_of_ten"]


# ------------------------------------------------------------------ the algorithms
@reference
def ring_all_reduce(tensor, op: Any = "sum", *, trace: RankTrace | None = None):
    """Chunked ring all-reduce of ``tensor`` in place (call it inside a rank); returns it.

    Args:
        tensor: this rank's tensor (any shape and dtype; on the rank's GPU with NCCL).
        op: "sum" or "mean" (also ``dist.ReduceOp.SUM`` / ``AVG``).
        trace: a :class:`RankTrace` to record the messages and chunk values into.
    """
    import torch.distributed as dist
    mean = _check(tensor, op, "ring_all_reduce")
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = flat.tensor_split(n)                     # views; sizes differ by at most 1
    right, left = (rank + 1) % n, (rank - 1) % n
    buf = _scratch(chunks[0]) if n > 1 else None     # chunk 0 is the largest
    if trace is not None:
        trace.start(flat)
    for step, (send_c, recv_c) in enumerate(_ring_chunks(rank, n), start=1):
        scatter = step <= n - 1                       # reduce-scatter (add), then all-gather
        _exchange(chunks[send_c], right, chunks[recv_c], left, buf if scatter else None, trace,
                  step, send_c, recv_c)
        if trace is not None:
            trace.snapshot()
    return _finish(tensor, flat, mean, n)


@reference
def naive_all_reduce(tensor, op: Any = "sum", *, trace: RankTrace | None = None):
    """All-reduce through rank 0, in place: it receives every tensor, adds, sends the sum back.

    Rank 0 talks to one peer per step (its one link is the bottleneck): steps 1..N-1 receive
    from ranks 1..N-1, steps N..2(N-1) send to them. Same arguments as :func:`ring_all_reduce`.
    """
    import torch.distributed as dist
    mean = _check(tensor, op, "naive_all_reduce")
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    buf = flat.new_empty(flat.numel()) if rank == 0 and n > 1 else None
    if trace is not None:
        trace.start(flat)
    for step in range(1, 2 * (n - 1) + 1):
        peer = step if step <= n - 1 else step - (n - 1)
        sending = (step <= n - 1) != (rank == 0)      # non-masters send first, master second
        if rank in (0, peer) and flat.numel():
            t0 = now()
            if sending:
                dist.send(flat, 0 if rank else peer)
            else:
                dist.recv(buf if rank == 0 else flat, 0 if rank else peer)
            if rank == 0 and step <= n - 1:
                flat.add_(buf)                        # t0 + t1 + ... in rank order
            if trace is not None:
                trace.record("send" if sending else "recv", 0 if rank else peer,
                             flat.numel() * flat.element_size(), step, None, t0, _sync_now(flat))
        if trace is not None:
            trace.snapshot()
    return _finish(tensor, flat, mean, n)


@reference
def _ring_chunks(rank: int, n: int):
    """(chunk sent, chunk received) by ``rank`` in each of the 2(N-1) ring steps.

    Marked as a lab reference (:mod:`labkit.grading.references`), like :func:`ring_schedule`:
    which chunk moves in which step is what the 03.reduce_scatter_step build asks."""
    for s in range(n - 1):                            # reduce-scatter
        yield (rank - s) % n, (rank - s - 1) % n
    for s in range(n - 1):                            # all-gather: pass the reduced chunks on
        yield (rank + 1 - s) % n, (rank - s) % n


def send_right_recv_left(send, like):
    """One ring message pair, inside a rank: send ``send`` to the right neighbour, rank
    (r+1) mod N, while receiving from the left neighbour, rank (r-1) mod N, a tensor shaped
    like ``like``; return what arrived (a new tensor: ``like`` itself is left as it was).

    Both messages are posted before either is waited for, so no rank waits for a neighbour
    that is itself waiting (notebook 03 §6.1); on NCCL the pair goes in one
    ``batch_isend_irecv`` group. An empty tensor is not sent, and an empty ``like`` receives
    nothing (a tensor shorter than N has empty chunks). The received buffer starts as zeros:
    gloo accepts a message shorter than the buffer without an error and leaves the rest as it
    was. It is not the lesson: which chunk to send and which to receive is
    (``lk.exercise.check("03.reduce_scatter_step", ...)``).

    Example (rank r of N, each chunk ``c`` a view of the rank's tensor)::

        incoming = lk.collectives.send_right_recv_left(chunks[r], chunks[(r - 1) % n])
    """
    import torch
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    incoming = torch.zeros_like(like, memory_format=torch.contiguous_format)
    out = send if send.is_contiguous() else send.contiguous()
    ops = [(f, t, peer) for f, t, peer in ((dist.irecv, incoming, (rank - 1) % n),
                                            (dist.isend, out, (rank + 1) % n)) if t.numel()]
    _post_and_wait(ops, out.is_cuda)
    return incoming


def _post_and_wait(ops: list, cuda: bool) -> None:
    """Post ``ops`` (``(dist.irecv or dist.isend, tensor, peer)``, the receive first) and wait
    for them all. On NCCL (``cuda``) they go in one ``batch_isend_irecv`` group: two ranks that
    each queue a lone send first can wait for each other forever."""
    import torch.distributed as dist
    if not ops:
        return
    if cuda:
        works = dist.batch_isend_irecv([dist.P2POp(f, t, peer) for f, t, peer in ops])
    else:
        works = [f(t, peer) for f, t, peer in ops]
    for w in works:
        w.wait()


def _exchange(out, right: int, target, left: int, buf, trace, step: int, send_c: int,
              recv_c: int) -> None:
    """One ring step: send ``out`` to the right while the same-sized chunk comes from the left,
    received into ``buf`` and added into ``target`` (reduce-scatter: ``buf`` given) or written
    straight into ``target`` (all-gather: ``buf`` None).

    The receive is posted before the send: gloo moves no data until the receiver has posted its
    receive (the sender waits for its "ready to receive" notice), so posting it first lets the
    transfer start sooner; :func:`_post_and_wait` posts the pair (one NCCL group on GPUs).
    """
    import torch.distributed as dist
    add = buf is not None
    incoming = buf[:target.numel()] if add else target
    ops = [op for op in ((dist.irecv, incoming, left), (dist.isend, out, right)) if op[1].numel()]
    if not ops:                                       # empty chunks (tensor shorter than N)
        return
    t0 = now()
    sent, received = (_pieces(out), _pieces(target)) if add and not out.is_cuda else (1, 1)
    if sent > 1 or received > 1:
        _add_as_it_lands(out, right, sent, target, left, received, incoming)
    else:
        _post_and_wait(ops, out.is_cuda)
        if add and target.numel():
            target.add_(incoming)
    if trace is not None:
        end = _sync_now(out)
        for f, t, peer in ops:
            send = f is dist.isend
            trace.record("send" if send else "recv", peer, t.numel() * t.element_size(), step,
                         send_c if send else recv_c, t0, end)


PIECE_BYTES = 4 << 20   # a reduce-scatter chunk of twice this or more goes in pieces of 4-8 MiB


def _pieces(chunk) -> int:
    """How many messages a reduce-scatter chunk goes in: 1 below 2 * PIECE_BYTES, else
    ``bytes // PIECE_BYTES`` (pieces of at least PIECE_BYTES, under twice it). Worked out from
    the chunk that travels, so its sender and its receiver agree: neighbouring chunks of a
    length not divisible by N differ by one element, and can fall on either side of a step."""
    return max(1, chunk.numel() * chunk.element_size() // PIECE_BYTES)


def _add_as_it_lands(out, right: int, sent: int, target, left: int, received: int,
                     incoming) -> None:
    """A reduce-scatter step of a large chunk on CPU: ``out`` goes right in ``sent`` messages
    and the chunk from the left arrives in ``received``, all posted at once; each piece is
    added into ``target`` as soon as it has landed, while the later ones are still in flight.
    Before, the whole chunk was added after the whole transfer: the add of a 32 MiB chunk
    (~4 ms here) came on top of the two 32 MiB exchanges (17-23 ms each) of a 64 MiB all-reduce
    on 2 ranks. gloo's own ring overlaps its reduction with the transfer too, segment by
    segment (upstream gloo's ``gloo/allreduce.cc``). The sender splits ``out`` as the receiver
    splits ``target`` (the same chunk, the same :func:`_pieces`), and gloo matches messages
    between two ranks with one tag in the order they were posted. Not on GPUs: there the add
    is queued on the stream and runs after the whole receive; it is small there, and the pair
    stays one NCCL group."""
    import torch.distributed as dist
    receives = [(dist.irecv(p, left), t, p) for t, p in
                zip(target.tensor_split(received), incoming.tensor_split(received))]
    sends = [dist.isend(p, right) for p in out.tensor_split(sent)]
    for work, t, p in receives:
        work.wait()
        t.add_(p)
    for work in sends:
        work.wait()


_SCRATCH: dict = {}
KEEP_BYTES = 1 << 20      # chunks from this size on get the kept buffer; smaller ones a fresh one


def _scratch(like):
    """A receive buffer shaped like ``like``, kept between calls (per device and dtype): a fresh
    32 MiB buffer on every call cost 8192 new 4 KiB pages, a quarter of a 64 MiB all-reduce's
    time on 2 ranks. (gloo instead bounds its scratch to two segments of at most 1 MiB; NCCL keeps
    fixed per-peer buffers.) Only chunks of KEEP_BYTES or more: a small model's rank holds no
    tensor beyond its own (the tensor-parallel checker counts every live one). One caller at a
    time: the ring is synchronous and not thread-safe; the largest chunk seen stays allocated
    for the life of the rank."""
    if like.numel() * like.element_size() < KEEP_BYTES:
        return like.new_empty(like.numel())        # small: the allocator reuses its memory
    key = (like.device, like.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = like.new_empty(like.numel())
    return buf[:like.numel()]


def _sync_now(t) -> float:
    if t.is_cuda:                                     # GPU work is asynchronous
        import torch
        torch.cuda.synchronize(t.device)
    return now()


def _check(tensor, op: Any, who: str) -> bool:
    """Validate the call; True when the result is to be averaged."""
    import torch
    import torch.distributed as dist
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who} needs a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.layout != torch.strided:
        raise TypeError(f"{who} handles dense tensors only, got layout {tensor.layout}; "
                        f"call .to_dense() first.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who} talks to other ranks, but no process group is initialised "
                           f"in this process. Call it inside a function run by lk.run(...).")
    name = op.lower() if isinstance(op, str) else {dist.ReduceOp.SUM: "sum",
                                                   dist.ReduceOp.AVG: "mean"}.get(op)
    if name not in ("sum", "mean", "avg"):
        raise ValueError(f"{who} supports op='sum' or op='mean', got {op!r}.")
    if name != "sum" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{who}(op='mean') of a {tensor.dtype} tensor would not be a whole "
                        f"number: convert first (t.float()) or use op='sum'.")
    return name != "sum"


def _finish(tensor, flat, mean: bool, n: int):
    if mean:
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# ------------------------------------------------------------------ traffic
@reference
def ring_schedule(world_size: int) -> list[dict]:
    """The ring's plan: for each step, which chunk every rank sends to its right neighbour.

    >>> ring_schedule(3)[0]
    {'step': 1, 'phase': 'reduce-scatter', 'sends': [(0, 1, 0), (1, 2, 1), (2, 0, 2)]}

    ``sends`` holds ``(src, dst, chunk)``.
    """
    n = world_size
    per_rank = [list(_ring_chunks(r, n)) for r in range(n)]
    return [dict(step=k + 1, phase="reduce-scatter" if k < n - 1 else "all-gather",
                 sends=[(r, (r + 1) % n, per_rank[r][k][0]) for r in range(n)])
            for k in range(2 * (n - 1))]


def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(N-1)/N · S."""
    return 2 * (world_size - 1) / world_size * nbytes


def naive_master_bytes(nbytes: float, world_size: int) -> float:
    """Bytes rank 0 receives (and again sends) in the naive all-reduce: (N-1) · S."""
    return (world_size - 1) * nbytes


def expected_traffic(algorithm: str, numel: int, world_size: int,
                     element_size: int = 4) -> list[dict]:
    """Exact bytes each rank sends and receives, chunk sizes included (uneven splits too)."""
    import torch
    n, s = world_size, numel * element_size
    if algorithm == "naive":
        per = [(n - 1) * s] + [s] * (n - 1) if n > 1 else [0]
        return [dict(rank=r, sent=per[r], received=per[r]) for r in range(n)]
    if algorithm != "ring":
        raise ValueError(f"algorithm must be 'ring' or 'naive', got {algorithm!r}.")
    sizes = [int(c.numel()) * element_size for c in torch.empty(numel).tensor_split(n)]
    rows = []
    for r in range(n):
        plan = list(_ring_chunks(r, n))
        rows.append(dict(rank=r, sent=sum(sizes[c] for c, _ in plan),
                         received=sum(sizes[c] for _, c in plan)))
    return rows


def check_traffic(trace: Trace) -> list[dict]:
    """Measured bytes per rank next to the formulas: one row per rank, with ``ok``.

    Rows: rank, sent, received, expected (exact, uneven chunks included) and formula
    (2(N-1)/N·S for the ring; (N-1)·S at the master, S elsewhere for naive).
    """
    exp = expected_traffic(trace.algorithm, trace.numel, trace.world_size, trace.element_size)
    n, s = trace.world_size, trace.nbytes
    rows = []
    for got, want in zip(trace.traffic(), exp):
        formula = ring_bytes_per_rank(s, n) if trace.algorithm == "ring" else (
            naive_master_bytes(s, n) if got["rank"] == 0 else s)
        rows.append(dict(got, expected=want["sent"], formula=formula,
                         ok=got["sent"] == want["sent"] and got["received"] == want["received"]))
    return rows


# ------------------------------------------------------------------ recording a run
def powers_of_ten(rank: int, world_size: int, numel: int):
    """Rank r holds 10**r everywhere, so a sum's digits say which ranks it contains (1011)."""
    import torch
    return torch.full((numel,), float(10 ** rank))


def _record_job(rank: int, world_size: int, fn, algorithm: str, numel: int, make, op: str,
                max_values: int):
    import torch
    import torch.distributed as dist

    from ..common.ranks import uses_nccl
    t = make(rank, world_size, numel)
    if uses_nccl():
        t = t.to(torch.device("cuda", rank))
    dist.barrier()                                # start together: times line up across ranks
    if fn is None:
        tr = RankTrace(rank, world_size, algorithm, max_values)
        (ring_all_reduce if algorithm == "ring" else naive_all_reduce)(t, op, trace=tr)
        return tr
    with tracing(t, algorithm, max_values) as tr:
        out = fn(t)
    if isinstance(out, torch.Tensor) and out.data_ptr() != t.data_ptr():
        t.copy_(out.reshape(t.shape))             # a function that returns a new tensor
        tr.frames[-1] = [t.view(-1)[a:min(b, a + max_values)].cpu().tolist()
                         for a, b in tr.bounds]
    return tr


def record(algorithm: str | Callable = "ring", world_size: int = 4, numel: int = 8, *,
           make: Callable = powers_of_ten, op: str = "sum", max_values: int = 8,
           timeout: float = 20.0, backend: str = "auto") -> Trace:
    """Run one traced all-reduce on ``world_size`` real ranks and return its :class:`Trace`.

    Args:
        algorithm: "ring", "naive", or your own function ``fn(tensor)`` that all-reduces
            ``tensor`` in place with ``dist.isend/irecv`` (it is watched with :func:`tracing`).
        numel: elements in each rank's tensor; ``make(rank, world_size, numel)`` builds it
            (default :func:`powers_of_ten`).

    Example::

        trace = lk.collectives.record("ring", world_size=4, numel=8)
        trace.sent(rank=2, step=3)          # bytes rank 2 sent in step 3
    """
    fn = None if isinstance(algorithm, str) else algorithm
    if fn is None and algorithm not in ("ring", "naive"):
        raise ValueError(f"algorithm must be 'ring', 'naive' or a function, got {algorithm!r}.")
    label = algorithm if fn is None else "ring"
    res = run(_record_job, world_size, args=(fn, label, numel, make, op, max_values),
              timeout=timeout, backend=backend)
    return Trace(res.values)
