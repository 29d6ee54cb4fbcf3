"""Recorded traffic of an all-reduce: who sent which chunk to whom, when, and what every rank held.

A collective is a schedule of point-to-point messages. Notebook 03 records that
schedule from a real run and replays it (:mod:`labkit.collectives.player`), so each rank
keeps a :class:`RankTrace` while it runs and returns it with the job; the
notebook merges them into one :class:`Trace`.

Two ways to fill a :class:`RankTrace`:

* explicitly, by an algorithm that knows its own steps
  (``lk.collectives.ring_all_reduce(t, trace=tr)``);
* by watching any function, for example the learner's own ring, with
  :func:`tracing`: inside the ``with`` block ``dist.isend/irecv/send/recv``
  are recorded; the k-th send of a rank is its step k.

Steps are numbered from 1; ``frames[k]`` holds every rank's chunk values after
step k (``frames[0]``: before the first step). Times are
``time.perf_counter()`` (system-wide monotonic clock on Linux), shifted so the
first message starts at 0.

Example (inside a rank)::

    tr = RankTrace(rank, world_size, "ring")
    lk.collectives.ring_all_reduce(t, trace=tr)
    return tr                      # -> Trace(res.values)
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Event", "RankTrace", "Trace", "tracing", "phase_of", "COLLECTIVES"]

now = time.perf_counter
PHASES = {"ring": ("reduce-scatter", "all-gather"), "naive": ("reduce", "broadcast")}
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast", "gather", "scatter", "all_to_all",
               "all_to_all_single")
_P2P = ("isend", "irecv", "send", "recv")


def phase_of(algorithm: str, step: int, world_size: int) -> str:
    """Phase name of a step (1-based): steps 1..N-1 are the first phase, N..2(N-1) the second."""
    first, second = PHASES.get(algorithm, ("step", "step"))
    return first if step <= world_size - 1 else second


@dataclass(frozen=True)
class Event:
    """One send or receive as one rank saw it. ``chunk`` is None for the whole tensor."""

    rank: int
    step: int
    phase: str
    op: str                 # "send" or "recv"
    peer: int
    chunk: int | None
    bytes: int
    start: float            # seconds since the first message of the run
    end: float | None       # None when the rank never waited for it

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


class RankTrace:
    """What one rank sent, received and held during one all-reduce (picklable).

    Args:
        rank, world_size: this rank's place in the job.
        algorithm: "ring", "naive" or any label (names the phases, see :func:`phase_of`).
        max_values: how many values of each chunk a frame keeps (frames stay small).
    """

    def __init__(self, rank: int, world_size: int, algorithm: str = "ring",
                 max_values: int = 8) -> None:
        self.rank, self.world_size, self.algorithm = rank, world_size, algorithm
        self.max_values = max_values
        self.numel = 0
        self.element_size = 0
        self.dtype = ""
        self.bounds: list[tuple[int, int]] = []
        self.events: list[dict] = []
        self.frames: list[list[list]] = []
        self.collectives: list[str] = []   # collectives called while watching (see tracing)
        self._flat = None
        self._counts = {"send": 0, "recv": 0}

    def start(self, flat) -> None:
        """Follow ``flat`` (a 1-D tensor, split into ``world_size`` chunks) and take frame 0."""
        self._flat = flat
        self.numel, self.element_size = flat.numel(), flat.element_size()
        self.dtype = str(flat.dtype).replace("torch.", "")
        ends = [int(c.numel()) for c in flat.tensor_split(self.world_size)]
        self.bounds, lo = [], 0
        for n in ends:
            self.bounds.append((lo, lo + n))
            lo += n
        self.frames = []
        self.snapshot()

    def snapshot(self) -> None:
        """Append the current values of every chunk (after the step just finished)."""
        flat = self._flat.detach()
        self.frames.append([flat[a:min(b, a + self.max_values)].cpu().tolist()
                            for a, b in self.bounds])

    def record(self, op: str, peer: int, nbytes: int, step: int, chunk: int | None,
               start: float, end: float | None = None, phase: str | None = None) -> int:
        """Add one event; returns its index (to set ``end`` later with :meth:`finish_event`)."""
        self.events.append(dict(rank=self.rank, step=step, op=op, peer=peer, chunk=chunk,
                                bytes=nbytes, start=start, end=end, phase=phase or phase_of(
                                    self.algorithm, step, self.world_size)))
        return len(self.events) - 1

    def finish_event(self, index: int, end: float | None = None) -> None:
        self.events[index]["end"] = now() if end is None else end

    def chunk_of(self, tensor) -> int | None:
        """Which chunk of the followed tensor ``tensor`` is a view of (None if it is not one)."""
        flat = self._flat
        if flat is None or tensor.numel() == 0 or tensor.device != flat.device:
            return None
        if tensor.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            return None
        offset = (tensor.data_ptr() - flat.data_ptr()) // max(flat.element_size(), 1)
        for i, (a, b) in enumerate(self.bounds):
            if a <= offset < b:
                return i
        return None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_flat"] = None          # the tensor stays in the rank; values are in frames
        return state

    def __repr__(self) -> str:
        return (f"RankTrace(rank {self.rank} of {self.world_size}, {self.algorithm}, "
                f"{len(self.events)} events, {len(self.frames)} frames)")


# ----------------------------------------------------------------- watching
class _TracedWork:
    """A ``Work`` whose ``wait()`` stamps the end time of its event."""

    def __init__(self, work, trace: RankTrace, index: int) -> None:
        self._work, self._trace, self._index = work, trace, index

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._trace.finish_event(self._index)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _p2p_wrapper(trace: RankTrace, name: str, orig):
    op = "send" if "send" in name else "recv"
    blocking = not name.startswith("i")

    def wrapper(tensor, *args, **kwargs):
        if op == "send" and trace._counts["send"] > 0:
            trace.snapshot()                      # state after the previous step
        trace._counts[op] += 1
        start = now()
        out = orig(tensor, *args, **kwargs)
        peer = args[0] if args else kwargs.get("dst" if op == "send" else "src")
        if peer is None:
            peer = kwargs.get("group_dst" if op == "send" else "group_src")
        if peer is None and op == "recv" and blocking:
            peer = out                            # recv from any source returns the source
        index = trace.record(op, -1 if peer is None else int(peer),
                             tensor.numel() * tensor.element_size(), trace._counts[op],
                             trace.chunk_of(tensor), start)
        if blocking:
            trace.finish_event(index)
            return out
        return _TracedWork(out, trace, index) if out is not None else out

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = orig
    return wrapper


def _collective_wrapper(trace: RankTrace, name: str, orig):
    def wrapper(*args, **kwargs):
        trace.collectives.append(name)
        return orig(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = orig
    return wrapper


@contextmanager
def tracing(tensor, algorithm: str = "ring", max_values: int = 8) -> Iterator[RankTrace]:
    """Record every ``dist.isend/irecv/send/recv`` made inside the block (call it in a rank).

    ``tensor`` is the tensor being all-reduced (contiguous): frames show its chunks. Calls to
    collectives such as ``dist.all_reduce`` are listed in ``trace.collectives``.

    Example::

        with tracing(t) as tr:
            my_ring_all_reduce(t)
        return tr
    """
    import torch.distributed as dist
    c10d = dist.distributed_c10d
    if not tensor.is_contiguous():
        raise ValueError("tracing() follows the chunks of a contiguous tensor; pass "
                         "t.contiguous() (a transposed or sliced tensor has no single layout).")
    trace = RankTrace(dist.get_rank(), dist.get_world_size(), algorithm, max_values)
    trace.start(tensor.view(-1))
    saved = []
    for name in _P2P + COLLECTIVES:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        wrap = (_p2p_wrapper if name in _P2P else _collective_wrapper)(trace, name, orig)
        for mod in (dist, c10d):        # c10d too: P2POp / batch_isend_irecv look there
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, wrap)
    try:
        yield trace
        trace.snapshot()                # after the last step
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)
        trace._flat = None


# ------------------------------------------------------------------ merging
class Trace:
    """The merged trace of one all-reduce on every rank, in step order.

    Args:
        ranks: the :class:`RankTrace` each rank returned (``res.values``), in rank order.

    Attributes: ``world_size``, ``algorithm``, ``numel``, ``element_size``, ``dtype``,
    ``nbytes`` (S, the tensor's size in bytes), ``chunk_numels``, ``events`` (list of
    :class:`Event`), ``frames`` (``frames[k][rank][chunk]`` = values after step k),
    ``steps`` (number of steps).
    """

    def __init__(self, ranks: list[RankTrace]) -> None:
        ranks = list(ranks)
        for r, t in enumerate(ranks):
            if not isinstance(t, RankTrace):
                raise TypeError(f"rank {r} returned {type(t).__name__}, not a RankTrace: return "
                                f"the trace from the function each rank runs (`return tr`).")
        if not ranks:
            raise ValueError("no rank traces to merge (the job had no ranks?)")
        first = ranks[0]
        if len(ranks) != first.world_size or [t.rank for t in ranks] != list(range(len(ranks))):
            raise ValueError(f"expected one trace per rank 0..{first.world_size - 1} in order, got "
                             f"ranks {[t.rank for t in ranks]}; pass res.values unchanged.")
        self.world_size, self.algorithm = first.world_size, first.algorithm
        self.numel, self.element_size, self.dtype = first.numel, first.element_size, first.dtype
        self.nbytes = self.numel * self.element_size
        self.chunk_numels = [b - a for a, b in first.bounds]
        self.collectives = {t.rank: list(t.collectives) for t in ranks if t.collectives}
        n_frames = min(len(t.frames) for t in ranks)
        self.frames = [[t.frames[k] for t in ranks] for k in range(n_frames)]
        self.steps = max(n_frames - 1, max((e["step"] for t in ranks for e in t.events), default=0))
        self.events = self._merge([e for t in ranks for e in t.events])

    def _merge(self, raw: list[dict]) -> list[Event]:
        raw = [dict(e) for e in raw]
        # The i-th send a->b pairs with the i-th recv at b from a (gloo and NCCL keep order).
        sends: dict[tuple, list] = {}
        for e in raw:
            if e["op"] == "send":
                sends.setdefault((e["rank"], e["peer"]), []).append(e)
        taken: dict[tuple, int] = {}
        for e in raw:
            if e["op"] == "recv":
                key = (e["peer"], e["rank"])
                i = taken.get(key, 0)
                taken[key] = i + 1
                if i < len(sends.get(key, [])) and e["chunk"] is None:
                    e["chunk"] = sends[key][i]["chunk"]
        t0 = min((e["start"] for e in raw), default=0.0)
        for e in raw:
            e["start"] -= t0
            e["end"] = None if e["end"] is None else e["end"] - t0
        raw.sort(key=lambda e: (e["step"], e["rank"], e["op"] != "send"))
        return [Event(**e) for e in raw]

    def phase(self, step: int) -> str:
        return phase_of(self.algorithm, step, self.world_size)

    def at(self, step: int, op: str | None = None) -> list[Event]:
        """Events of one step (1-based), optionally only ``op`` ("send"/"recv")."""
        return [e for e in self.events if e.step == step and (op is None or e.op == op)]

    def sent(self, rank: int, step: int | None = None) -> int:
        """Bytes ``rank`` sent, in one step or (``step=None``) in the whole run."""
        return sum(e.bytes for e in self.events
                   if e.rank == rank and e.op == "send" and (step is None or e.step == step))

    def received(self, rank: int, step: int | None = None) -> int:
        """Bytes ``rank`` received, in one step or in the whole run."""
        return sum(e.bytes for e in self.events
                   if e.rank == rank and e.op == "recv" and (step is None or e.step == step))

    def traffic(self) -> list[dict]:
        """Bytes sent and received by each rank: ``[{"rank", "sent", "received"}, ...]``."""
        return [dict(rank=r, sent=self.sent(r), received=self.received(r))
                for r in range(self.world_size)]

    def table(self) -> str:
        """Every message as a text table, step by step."""
        lines = [f"{'step':>4}  {'phase':<14} {'rank':>4} {'op':<4} {'peer':>4} {'chunk':>5} "
                 f"{'bytes':>8} {'start ms':>9} {'end ms':>8}"]
        for e in self.events:
            end = "-" if e.end is None else f"{e.end * 1e3:.3f}"
            chunk = "all" if e.chunk is None else e.chunk
            lines.append(f"{e.step:>4}  {e.phase:<14} {e.rank:>4} {e.op:<4} {e.peer:>4} "
                         f"{chunk:>5} {e.bytes:>8} {e.start * 1e3:>9.3f} {end:>8}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Trace({self.algorithm}, {self.world_size} ranks, {self.numel} x {self.dtype} "
                f"= {self.nbytes} bytes, {self.steps} steps, {len(self.events)} events)")
