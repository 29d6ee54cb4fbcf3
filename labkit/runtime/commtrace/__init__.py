"""See every collective: what each rank sent, to whom, when, and how long it waited (notebook 07).

``lk.run(fn, n, trace=True)`` records, on every rank and without a change to ``fn``, every
collective and point-to-point operation that reaches PyTorch's dispatcher: ``dist.*`` calls,
methods of a ``ProcessGroup`` object (``group.allreduce([t])``), functional collectives, and the
ones PyTorch's own C++ issues (DDP's bucket all-reduces, a comm hook's, FSDP2's), from the
job's thread, every thread started while it runs and every future callback. The job's
:class:`~labkit.runtime.result.JobResult` then has ``res.trace``, a :class:`CommTrace`.

Exactly what is seen: an op is recorded when it reaches the dispatcher in a thread where the
recorder's dispatch mode is active, which is (1) the thread that entered the recorder, (2) every
thread started through Python (``threading``, ``concurrent.futures``, ``_thread``) while it
is active, (3) every callback of ``Future.then`` / ``add_done_callback`` registered while it
is active, wherever it runs (often gloo's own thread), and (4) threads to which torch carries
its thread-local state (the autograd engine's). Not seen: a call on a backend object directly
(``group._get_backend(device).allreduce(...)`` skips the dispatcher), code that switches
dispatch modes off, threads that existed before the recorder was entered, threads started
outside Python, and bytes that leave the process another way (the store, a file, a socket). A
checker that must know how an answer's result came about therefore also checks what only the
recorded route produces (``labkit.scaling.check``: the gradients are exactly what the recorded
fp16 all-reduce produced from each rank's share).

How it sees them. :class:`CommRecorder` pushes a ``TorchDispatchMode`` that notes each
``c10d::*`` / ``_c10d_functional::*`` op as it is issued, and learns when it finished:

* a collective's end comes from its ``Work``'s future (``get_future().then(...)``), which gloo
  completes from its own thread the moment the collective is done;
* gloo's send/recv works have no future ("Work::getFuture not implemented") and report
  ``is_completed()`` False until someone calls ``wait()`` (torch 2.13, measured), so their end
  is when ``wait()`` returned in this rank: :class:`CommRecorder` wraps ``Work.wait`` while it
  is active, which also gives every op's *wait span* (the time the rank sat blocked in
  ``wait()``: a straggler's peers show long ones);
* a functional collective ends at its ``wait_tensor``.

Ops issued from a future's callback (PowerSGD all-reduces its P and Q matrices from
``fut.then(...)`` callbacks) run on whichever thread completes the future, often gloo's own,
where the dispatch mode is not active (a dispatch mode is per thread): while recording,
``Future.then`` and ``Future.add_done_callback`` are wrapped so that each callback runs with the
recorder active in its thread. Without that, PowerSGD's P and Q all-reduces went unseen in about
half of the steps (measured). Thread starts are wrapped the same way (``_thread.start_new_thread``
and ``threading``'s reference to it): a helper thread's collectives are recorded too.

``CommRecorder(keep_tensors=True)`` (for checkers, not ``lk.run``) also keeps, per record,
``"sent"``: copies of the op's input tensors taken before it ran, and ``"received"``: copies of
what it produced, taken when it finished (the value of its ``Work``'s future, or the tensor at
``wait_tensor``); ``None`` where that end is not observed (gloo's send/recv).

Times are ``time.perf_counter()`` (Linux: the system-wide monotonic clock), so the ranks share
one time axis. On NCCL the end of a collective is when the CPU learned that it was enqueued,
not when the GPU finished it: use ``torch.profiler`` for kernel times.

Cost: a dispatch mode sends *every* torch op of the rank through Python while it is active,
so ``trace=True`` slows compute (a small MLP step took about twice as long here, measured in
notebook 07); measure speed with ``trace=False`` (the default installs nothing) and count
with ``trace=True``.

A record (a plain dict)::

    {"rank": 0, "seq": 3, "kind": "all_reduce", "op": "allreduce_", "bytes": 4096,
     "dtype": "torch.float32", "group_size": 4, "group_ranks": (0, 1, 2, 3), "peer": None,
     "label": "", "start": 812.0031, "end": 812.0042, "wait_start": 812.0032,
     "wait_end": 812.0042, "thread": "MainThread"}

``bytes`` is the payload S: the whole tensor being reduced (all-reduce, reduce, the input of a
reduce-scatter), gathered (the output of an all-gather or gather), broadcast, scattered,
exchanged (the input of an all-to-all) or sent/received; 0 for a barrier. ``peer`` is the global
rank at the other end of a send/recv, or the root of a broadcast/reduce/gather/scatter.

Inside a rank, :func:`label` tags what follows (``with commtrace.label("backward"): ...``); it
does nothing when no recorder is active, so lesson code can label unconditionally.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["CommRecorder", "CommTrace", "KINDS", "FIELDS", "current", "label"]

from .view import CommTrace  # noqa: E402  (the notebook's side, re-exported here)

KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "send", "isend": "send", "recv_": "recv", "recv_any_source_": "recv", "irecv": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
FIELDS = ("rank", "seq", "kind", "op", "bytes", "dtype", "group_size", "group_ranks", "peer",
          "label", "start", "end", "wait_start", "wait_end", "thread")
_NAMESPACES = ("c10d", "_c10d_functional")
_SKIP = ("check_for_nan", "wait_tensor", "_wrap_tensor_autograd")   # bookkeeping, no data
_ROOTED = {"broadcast": "root_rank", "reduce": "root_rank", "gather": "root_rank",
           "scatter": "root_rank"}
_KEEP_WORKS = 512        # works remembered for wait() spans (a window: tensors are not kept)

_active: list["CommRecorder"] = []
_active_lock = threading.Lock()
_originals: list[tuple[Any, str, Any]] = []     # (owner, name, original) while recording
_original_then = None


# ------------------------------------------------------------------- the rank side
class CommRecorder:
    """Record every collective and point-to-point op this rank issues inside ``with``, from
    this thread, threads started inside the block and future callbacks (module docstring).

    Args:
        rank: stored in every record (default: this process's global rank).
        max_records: stop recording after this many (``dropped`` counts the rest).
        keep_tensors: also keep copies of what each op sent and received (``"sent"``,
            ``"received"``; see the module docstring).

    Example (inside a rank; ``lk.run(..., trace=True)`` does this around the whole job)::

        with CommRecorder() as rec:
            loss.backward()
        rec.records        # [{"kind": "all_reduce", "bytes": ..., "start": ..., ...}]
    """

    def __init__(self, rank: int | None = None, max_records: int = 200_000,
                 keep_tensors: bool = False) -> None:
        self.rank, self.max_records, self.keep_tensors = rank, max_records, keep_tensors
        self.records: list[dict] = []
        self.label, self.dropped = "", 0
        self._works: OrderedDict[int, tuple[Any, dict]] = OrderedDict()
        self._tensors: dict[int, dict] = {}       # functional collectives until wait_tensor
        self._mode = None

    # -- entering and leaving
    def __enter__(self) -> "CommRecorder":
        import torch.distributed as dist

        if self.rank is None:
            self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._mode = _mode_class()(self)
        with _active_lock:
            if not _active:
                _patch()
            _active.append(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            with _active_lock:
                if self in _active:
                    _active.remove(self)
                if not _active:
                    _unpatch()
            self.settle()
            self._works.clear()
            self._tensors.clear()

    def settle(self, timeout: float = 0.05) -> None:
        """Give collectives still in flight a moment to report their end (then ``end`` stays None)."""
        deadline = time.perf_counter() + timeout
        while (any(r["end"] is None and r.get("_future") for r in self.records)
               and time.perf_counter() < deadline):
            time.sleep(0.001)
        for r in self.records:
            r.pop("_future", None)

    @contextmanager
    def labelled(self, name: str) -> Iterator[None]:
        """Tag the records of the ``with`` block with ``name`` (restored afterwards)."""
        old, self.label = self.label, str(name)
        try:
            yield
        finally:
            self.label = old

    # -- called by the dispatch mode and by Work.wait
    def _before(self, func, args, kwargs) -> list | None:
        """Copies of the op's input tensors, taken before it runs (``keep_tensors`` only)."""
        if not self.keep_tensors or func._schema.name.split("::")[-1] in _SKIP:
            return None
        return [t.detach().clone() for t in _inputs(_bind(func, args, kwargs))]

    def _issued(self, func, args, kwargs, out, start: float, sent: list | None = None) -> None:
        op = func._schema.name.split("::")[-1]
        if op in _SKIP:
            if op == "wait_tensor" and args:
                rec = self._tensors.pop(_key(args[0]), None)
                if rec is not None and rec["end"] is None:
                    rec["end"] = time.perf_counter()
                    if self.keep_tensors:
                        rec["received"] = _copies(args[0])
            return
        if len(self.records) >= self.max_records:
            self.dropped += 1
            return
        bound = _bind(func, args, kwargs)
        kind = KINDS.get(op, op)
        size, ranks = _group(bound)
        rec = {"rank": self.rank, "seq": len(self.records), "kind": kind, "op": op,
               "bytes": _payload(kind, bound, size), "dtype": _dtype(bound),
               "group_size": size, "group_ranks": ranks, "peer": _peer(kind, bound, ranks),
               "label": self.label, "start": start, "end": None, "wait_start": None,
               "wait_end": None, "thread": threading.current_thread().name}
        if self.keep_tensors:
            rec["sent"], rec["received"] = sent, None
        self.records.append(rec)
        if func.namespace == "_c10d_functional":
            self._tensors[_key(out[0] if isinstance(out, (list, tuple)) else out)] = rec
            return
        self._watch(out[-1] if isinstance(out, (tuple, list)) else out, rec)

    def _watch(self, boxed, rec: dict) -> None:
        from torch._C._distributed_c10d import Work

        try:
            work = Work.unbox(boxed)
        except Exception:  # noqa: BLE001  (no work object: a blocking op, done on return)
            if rec["kind"] == "barrier" or boxed is None:
                rec["end"] = time.perf_counter()
            return
        self._works[id(work)] = (work, rec)
        while len(self._works) > _KEEP_WORKS:
            self._works.popitem(last=False)
        try:
            fut = work.get_future()
        except RuntimeError:           # gloo send/recv: the end is when wait() returns
            return
        rec["_future"] = True

        def done(_fut, rec=rec, keep=self.keep_tensors):
            rec["end"] = time.perf_counter()
            rec["_future"] = False
            if keep:
                try:
                    rec["received"] = _copies(_fut.value())
                except Exception:  # noqa: BLE001  (the op failed: it received nothing)
                    pass
        (_original_then or type(fut).then)(fut, done)

    def _waited(self, work, t0: float, t1: float) -> None:
        hit = self._works.get(id(work))
        if hit is None or hit[0] is not work:
            return
        rec = hit[1]
        if rec["wait_start"] is None:
            rec["wait_start"] = t0
        rec["wait_end"] = t1
        if rec["end"] is None or rec["end"] > t1:
            rec["end"] = t1


def current() -> CommRecorder | None:
    """The innermost active recorder of this process, or None."""
    return _active[-1] if _active else None


@contextmanager
def label(name: str) -> Iterator[None]:
    """Tag the ops issued in the block with ``name``, in every active recorder (else no-op)."""
    recorders = list(_active)
    old = [r.label for r in recorders]
    for r in recorders:
        r.label = str(name)
    try:
        yield
    finally:
        for r, o in zip(recorders, old):
            r.label = o


_mode_cls = None


def _mode_class():
    """The TorchDispatchMode subclass, made once torch is imported (never in the notebook)."""
    global _mode_cls
    if _mode_cls is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class _CommMode(TorchDispatchMode):
            def __init__(self, recorder: CommRecorder) -> None:
                super().__init__()
                self.recorder = recorder

            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # Otherwise torch wraps __torch_dispatch__ in torch._dynamo.disable, which
                # imports torch._dynamo (seconds in a fresh rank); this mode is never compiled.
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                recorder = self.recorder
                if func.namespace not in _NAMESPACES or recorder not in _active:
                    return func(*args, **(kwargs or {}))   # (a thread that outlived the block)
                sent = recorder._before(func, args, kwargs)
                start = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                recorder._issued(func, args, kwargs, out, start, sent)
                return out
        _mode_cls = _CommMode
    return _mode_cls


def _patch() -> None:
    """While recording: wrap ``Work.wait`` (wait spans, p2p ends), the callbacks of
    ``Future.then`` / ``add_done_callback`` and the start of every Python thread, so that a
    callback or a new thread runs with the active recorders in its own thread too."""
    global _original_then
    import _thread

    import torch
    from torch._C._distributed_c10d import Work

    wait_ = Work.wait
    then_, add_done_ = torch._C.Future.then, torch._C.Future.add_done_callback

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return wait_(self, *args, **kwargs)
        finally:
            t1 = time.perf_counter()
            for rec in list(_active):
                rec._waited(self, t0, t1)

    def then(self, callback):
        return then_(self, _carrying(callback))

    def add_done_callback(self, callback):
        return add_done_(self, _carrying(callback))

    def starting(start_):
        def start(function, *args, **kwargs):
            return start_(_carrying(function), *args, **kwargs)
        start.__doc__ = start_.__doc__
        return start

    wait.__doc__, then.__doc__ = wait_.__doc__, then_.__doc__
    add_done_callback.__doc__ = add_done_.__doc__
    _original_then = then_
    patches = [(Work, "wait", wait), (torch._C.Future, "then", then),
               (torch._C.Future, "add_done_callback", add_done_callback)]
    patches += [(owner, name, starting(getattr(owner, name)))     # Python 3.11: start_new_thread
                for owner, name in ((_thread, "start_new_thread"), (threading, "_start_new_thread"),
                                    (_thread, "start_joinable_thread"),
                                    (threading, "_start_joinable_thread"))
                if hasattr(owner, name)]
    for owner, name, new in patches:
        _originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)


def _unpatch() -> None:
    global _original_then
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)
    _original_then = None


def _carrying(fn):
    """``fn``, run with the recorders active now also active in whichever thread runs it."""
    recorders = list(_active)
    if not recorders:
        return fn

    def traced(*args, **kwargs):
        with _recording_here(recorders):
            return fn(*args, **kwargs)
    return traced


@contextmanager
def _recording_here(recorders: list[CommRecorder]) -> Iterator[None]:
    """Make ``recorders`` active in this thread too (a callback on gloo's thread)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    here = {id(m.recorder) for m in _get_current_dispatch_mode_stack()
            if isinstance(m, _mode_class())}
    entered = []
    try:
        for m in (_mode_class()(r) for r in recorders if id(r) not in here and r in _active):
            m.__enter__()
            entered.append(m)
    except Exception:  # noqa: BLE001  (a thread or callback must run even unrecorded)
        pass
    try:
        yield
    finally:
        for m in reversed(entered):
            m.__exit__(None, None, None)


# ---------------------------------------------------------------- reading an op's arguments
def _bind(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return dict(zip(names, args), **(kwargs or {}))


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _inputs(bound: dict) -> list:
    """The tensors an op is given to send or reduce (its first tensor argument)."""
    for key in ("tensors", "tensor", "input", "inputs", "input_tensor", "input_tensors"):
        if ts := _tensors(bound.get(key)):
            return ts
    return []


def _copies(value) -> list:
    return [t.detach().clone() for t in _tensors(value)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _key(t) -> int:
    """Identify a functional collective's output by its storage (AsyncCollectiveTensor
    wrappers hold it as ``.elem``)."""
    while hasattr(t, "elem") and t.elem is not t:
        t = t.elem
    try:
        return t.untyped_storage().data_ptr() ^ (t.storage_offset() << 1)
    except Exception:  # noqa: BLE001
        return id(t)


def _group(bound: dict) -> tuple[int, tuple[int, ...]]:
    """(size, global ranks) of the process group an op runs on."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

    try:
        group = None
        if bound.get("process_group") is not None:
            group = dist.ProcessGroup.unbox(bound["process_group"])
        elif bound.get("group_name") is not None:
            group = _resolve_process_group(bound["group_name"])
        if group is not None:
            return group.size(), tuple(get_process_group_ranks(group))
    except Exception:  # noqa: BLE001  (a group torch does not know by name: say what we can)
        pass
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"], ()
    n = dist.get_world_size() if dist.is_initialized() else 1
    return n, tuple(range(n))


def _payload(kind: str, bound: dict, n: int) -> int:
    """S, the bytes the op is about (see the module docstring)."""
    first = lambda *keys: next((ts for k in keys if (ts := _tensors(bound.get(k)))), [])  # noqa: E731
    if kind == "barrier":
        return 0
    if kind in ("all_gather", "gather"):
        out = first("output_tensor", "output_tensors", "output_lists", "outputs", "out")
        if out:
            return _nbytes(out)
        return _nbytes(first("input", "input_tensor", "input_tensors", "inputs")) * n
    if kind in ("reduce_scatter", "scatter"):
        return _nbytes(first("input_tensor", "input_tensors", "input", "inputs"))
    if kind == "all_to_all":
        return _nbytes(first("input", "input_tensors", "inputs"))
    return _nbytes(first("tensors", "tensor", "input", "inputs"))


def _dtype(bound: dict) -> str:
    ts = _inputs(bound)
    return str(ts[0].dtype) if ts else ""


def _peer(kind: str, bound: dict, ranks: tuple[int, ...]) -> int | None:
    local = bound.get({"send": "dst", "recv": "src"}.get(kind, _ROOTED.get(kind, "")))
    if isinstance(local, bool) or not isinstance(local, int):
        return None
    return ranks[local] if 0 <= local < len(ranks) else local
