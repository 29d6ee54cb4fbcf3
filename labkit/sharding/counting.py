"""Counting what a rank sends: every collective it issues, with its size (notebook 06 §3-§12).

The issue with "ZeRO-3 sends 1.5x what DDP sends" is that it is usually *computed*. Here it is
*counted*: :class:`CommCounter` is the runtime's recorder (:class:`labkit.runtime.commtrace.
CommRecorder`, the one mechanism that watches collectives; ``lk.run(..., trace=True)`` uses it
too), so it sees every ``torch.distributed`` operation that reaches PyTorch's dispatcher in
this rank — DDP's bucket all-reduces from inside
its C++ reducer, FSDP2's all-gathers and reduce-scatters, ``ZeroRedundancyOptimizer``'s
broadcasts, tensor parallelism's functional all-reduces and the ``isend``/``irecv`` of a
hand-written ring — whoever issued them (``tests/sharding/test_sharding.py`` checks each). The code under
test cannot skip the count.

For each call it records the kind, the payload ``S`` (the bytes of the whole tensor being
reduced or gathered), the group's size ``n`` and the current ``label``. Two totals come out:

* **volume** in ZeRO's units: all-reduce ``2S`` (a reduce-scatter and an all-gather), all-gather
  ``S``, reduce-scatter ``S``, broadcast ``S`` (collectives only: a hand-written ring's sends
  are counted as what they are, bytes sent). DDP moves 2Ψ per step, ZeRO-3 3Ψ.
* **ring bytes sent** per rank: what a ring implementation puts on this rank's link —
  all-reduce ``2(n-1)/n·S``, all-gather and reduce-scatter ``(n-1)/n·S`` each (notebook 03's
  two halves), broadcast ``(n-1)/n·S`` on average over the ranks (a chain: every rank but the
  last forwards ``S``), point-to-point sends exactly as sent.

Example (inside a rank)::

    with CommCounter() as comm:
        loss.backward()
    comm.totals()           # {'all_reduce': {'calls': 1, 'bytes': 29248, ...}}
    comm.volume()           # 58496 = 2 * 29248
"""
from __future__ import annotations

from collections import defaultdict

from ..runtime.commtrace import KINDS, CommRecorder

__all__ = ["CommCounter", "VOLUME", "KINDS"]

VOLUME = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0,
          "all_to_all": 1.0}    # ZeRO's units, multiples of the payload S (collectives only)


class CommCounter(CommRecorder):
    """Count every collective and point-to-point message this rank issues inside the block.

    Attributes:
        calls: one dict per operation (the recorder's records): ``kind``, ``bytes`` (payload
            S), ``group_size``, ``group_ranks`` (global ranks of the group), ``label``,
            ``start`` (``time.perf_counter()`` when it was issued) ...
        label: set it to tag the calls that follow (``"layer 0 forward"``, ``"step"``).
    """

    @property
    def calls(self) -> list[dict]:
        return self.records

    def clear(self) -> None:
        """Forget what was counted (keep counting)."""
        self.records = []

    def totals(self, by: str = "kind") -> dict[str, dict]:
        """``{kind: {"calls", "bytes", "volume", "ring_sent"}}`` (or grouped ``by="label"``)."""
        out: dict[str, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "volume": 0.0,
                                                    "ring_sent": 0.0})
        for c in self.calls:
            row = out[c[by]]
            row["calls"] += 1
            row["bytes"] += c["bytes"]
            row["volume"] += _volume(c)
            row["ring_sent"] += _ring_sent(c)
        return dict(out)

    def volume(self, label: str | None = None) -> float:
        """Bytes in ZeRO's units (all-reduce = 2S, all-gather = reduce-scatter = S)."""
        return sum(_volume(c) for c in self.calls if label is None or c["label"] == label)

    def ring_sent(self, label: str | None = None) -> float:
        """Bytes this rank's link carries when every collective is a ring (sends: as sent)."""
        return sum(_ring_sent(c) for c in self.calls if label is None or c["label"] == label)

    def kinds(self) -> list[str]:
        """The kinds of operation seen, in order of first use."""
        return list(dict.fromkeys(c["kind"] for c in self.calls))


def _volume(call: dict) -> float:
    return VOLUME.get(call["kind"], 0.0) * call["bytes"]


def _ring_sent(call: dict) -> float:
    n, s, kind = call["group_size"], call["bytes"], call["kind"]
    if kind == "send":
        return float(s)
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * s
    if kind in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        return (n - 1) / n * s
    return 0.0
