"""Reading a traced job: every rank's collectives, matched, summed, drawn and exported (notebook 07 §2).

:class:`CommTrace` is what ``lk.run(..., trace=True).trace`` returns: the records
:mod:`labkit.runtime.commtrace` made in each rank (their fields are listed there), with the
questions a learner asks of them — how many bytes of which kind, which collective each rank
reached last (the straggler), how long each rank waited, a per-rank timeline
(:func:`labkit.common.commplot.comm_timeline` draws it) and Chrome's Trace Event Format for
Perfetto / ``chrome://tracing``. Pure Python: it runs in the notebook without torch.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

__all__ = ["CommTrace"]


class CommTrace:
    """Every rank's records of one job: ``trace[r]`` is rank r's list (see the module docstring).

    >>> res = lk.run(step, 4, trace=True)
    >>> res.trace.totals()                 # {"all_reduce": {"calls": 2, "bytes": ...}, ...}
    >>> res.trace.matched()                # each collective across ranks: who came last
    >>> lk.plots.comm_timeline(res.trace)  # per-rank timeline, waits hatched
    >>> res.trace.to_chrome("job.json")    # open in https://ui.perfetto.dev
    """

    def __init__(self, per_rank: list[list[dict]], dropped: list[int] | None = None) -> None:
        self.per_rank = [list(recs) for recs in per_rank]
        self.dropped = list(dropped or [0] * len(self.per_rank))

    def __getitem__(self, rank: int) -> list[dict]:
        return self.per_rank[rank]

    def __len__(self) -> int:
        return len(self.per_rank)

    def __iter__(self):
        return iter(self.per_rank)

    @property
    def records(self) -> list[dict]:
        """Every record of every rank, by start time."""
        return sorted((r for recs in self.per_rank for r in recs), key=lambda r: r["start"])

    def select(self, rank: int | None = None, kind: str | None = None,
               label: str | None = None) -> list[dict]:
        """The records of one rank / kind / label (None: any)."""
        return [r for r in self.records if (rank is None or r["rank"] == rank)
                and (kind is None or r["kind"] == kind) and (label is None or r["label"] == label)]

    def kinds(self) -> list[str]:
        """Kinds of op seen, in order of first use."""
        return list(dict.fromkeys(r["kind"] for r in self.records))

    def bytes(self, rank: int | None = None, kind: str | None = None,
              label: str | None = None) -> int:
        """Total payload bytes of the matching records."""
        return sum(r["bytes"] for r in self.select(rank, kind, label))

    def totals(self, by: str = "kind", rank: int | None = None) -> dict[Any, dict]:
        """``{key: {"calls", "bytes", "seconds"}}`` grouped ``by`` any record field."""
        out: dict[Any, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "seconds": 0.0})
        for r in self.select(rank):
            row = out[r[by]]
            row["calls"] += 1
            row["bytes"] += r["bytes"]
            row["seconds"] += (r["end"] - r["start"]) if r["end"] is not None else 0.0
        return dict(out)

    def waits(self, rank: int) -> float:
        """Seconds rank ``rank`` spent blocked inside ``wait()``."""
        return sum(r["wait_end"] - r["wait_start"] for r in self.per_rank[rank]
                   if r["wait_start"] is not None)

    def t0(self) -> float:
        starts = [r["start"] for r in self.records]
        return min(starts) if starts else 0.0

    def matched(self, kinds: tuple[str, ...] | None = None) -> list[dict]:
        """Each collective across the ranks that ran it (matched by group and order, as gloo and
        NCCL match them): ``{kind, bytes, group_ranks, arrivals: {rank: start}, last (rank),
        skew (s)}``. The ``last`` rank is the straggler everyone else waited for. ``kinds``
        keeps only those kinds (matching still counts every collective of a group)."""
        calls: dict[tuple, dict] = {}
        for recs in self.per_rank:
            count: dict[tuple, int] = defaultdict(int)
            for r in recs:
                if r["kind"] in ("send", "recv") or not r["group_ranks"]:
                    continue
                g = tuple(r["group_ranks"])
                key = (g, count[g])
                count[g] += 1
                c = calls.setdefault(key, {"kind": r["kind"], "bytes": r["bytes"],
                                           "group_ranks": g, "arrivals": {}})
                c["arrivals"][r["rank"]] = r["start"]
        out = []
        for c in sorted(calls.values(), key=lambda c: min(c["arrivals"].values())):
            if kinds is not None and c["kind"] not in kinds:
                continue
            first = min(c["arrivals"].values())
            c["last"] = max(c["arrivals"], key=c["arrivals"].get)
            c["skew"] = c["arrivals"][c["last"]] - first
            out.append(c)
        return out

    def waited_for_peers(self, rank: int, kinds: tuple[str, ...] | None = None) -> float:
        """Seconds ``rank`` had a collective in flight before the group's last rank issued it:
        time lost to stragglers, whoever waited (a Python ``wait()`` or PyTorch's C++)."""
        return sum(m["arrivals"][m["last"]] - m["arrivals"][rank]
                   for m in self.matched(kinds) if rank in m["arrivals"])

    def table(self, limit: int = 20, kind: str | None = None) -> str:
        """The first ``limit`` records (of ``kind``) as text, times in ms from the job's first op."""
        t0 = self.t0()
        lines = [f"{'rank':>4} {'kind':<15} {'bytes':>10} {'group':<12} {'peer':>4} "
                 f"{'start ms':>9} {'dur ms':>8} {'wait ms':>8}  label"]
        chosen = self.select(kind=kind)
        for r in chosen[:limit]:
            dur = f"{(r['end'] - r['start']) * 1e3:8.3f}" if r["end"] is not None else "       ?"
            wait = (f"{(r['wait_end'] - r['wait_start']) * 1e3:8.3f}"
                    if r["wait_start"] is not None else "       -")
            peer = "" if r["peer"] is None else str(r["peer"])
            group = ",".join(map(str, r["group_ranks"]))
            lines.append(f"{r['rank']:>4} {r['kind']:<15} {r['bytes']:>10} {group:<12} "
                         f"{peer:>4} {(r['start'] - t0) * 1e3:9.3f} {dur} {wait}  {r['label']}")
        if len(chosen) > limit:
            lines.append(f"... {len(chosen) - limit} more records")
        return "\n".join(lines)

    def spans(self) -> list[list[dict]]:
        """Per-rank spans in :mod:`labkit.common.timeline`'s format, from time 0: lane ``comm``
        (issue to completion, one span per op) and lane ``wait`` (blocked in ``wait()``)."""
        t0 = self.t0()
        out = []
        for rank, recs in enumerate(self.per_rank):
            spans = []
            for r in recs:
                end = r["end"] if r["end"] is not None else r["start"]
                spans.append({"rank": rank, "lane": "comm", "kind": r["kind"],
                              "label": r["label"], "start": r["start"] - t0, "end": end - t0})
                if r["wait_start"] is not None:
                    spans.append({"rank": rank, "lane": "wait", "kind": "idle",
                                  "label": f"wait {r['kind']}", "start": r["wait_start"] - t0,
                                  "end": r["wait_end"] - t0})
            out.append(spans)
        return out

    def to_chrome(self, path: str | None = None) -> dict:
        """The trace in Chrome's Trace Event Format (Perfetto, ``chrome://tracing``).

        One process per rank; thread 0 holds the waits, threads 1.. the ops (overlapping async
        ops go on separate threads). Times in microseconds from the job's first op. Writes the
        JSON to ``path`` when given; returns the dict either way.
        """
        t0, events = self.t0(), []
        for rank, recs in enumerate(self.per_rank):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0,
                           "args": {"name": "blocked in wait()"}})
            lanes: list[float] = []
            for r in sorted(recs, key=lambda r: r["start"]):
                end = r["end"] if r["end"] is not None else r["start"]
                lane = next((i for i, free in enumerate(lanes) if free <= r["start"]), None)
                if lane is None:
                    lanes.append(0.0)
                    lane = len(lanes) - 1
                    events.append({"name": "thread_name", "ph": "M", "pid": rank,
                                   "tid": lane + 1, "args": {"name": f"ops {lane}"}})
                lanes[lane] = end
                args = {k: r[k] for k in ("op", "bytes", "dtype", "group_ranks", "peer",
                                          "label", "seq")}
                args["group_ranks"] = list(args["group_ranks"])
                args["completed"] = r["end"] is not None
                events.append({"name": r["kind"], "cat": "comm", "ph": "X", "pid": rank,
                               "tid": lane + 1, "ts": (r["start"] - t0) * 1e6,
                               "dur": (end - r["start"]) * 1e6, "args": args})
                if r["wait_start"] is not None:
                    events.append({"name": f"wait {r['kind']}", "cat": "wait", "ph": "X",
                                   "pid": rank, "tid": 0, "ts": (r["wait_start"] - t0) * 1e6,
                                   "dur": (r["wait_end"] - r["wait_start"]) * 1e6,
                                   "args": {"seq": r["seq"]}})
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"source": "labkit lk.run(..., trace=True)",
                             "ranks": len(self.per_rank)}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc

    def __repr__(self) -> str:
        n = [len(recs) for recs in self.per_rank]
        kinds = ", ".join(f"{k} x{v['calls']}" for k, v in self.totals().items())
        return f"CommTrace({len(self.per_rank)} ranks, records per rank {n}: {kinds or 'none'})"
