"""Reading torchrun's output: agent log lines, rank output, restarts and the error summary.

The agent (``LOGLEVEL=INFO``) writes glog-style lines::

    I1130 08:16:36.287000 13090 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 2/2 attempts left; will restart worker group

and, with ``--tee=3``, each worker's output prefixed by role and local rank
(``[default1]:step 12 ...``). When the job fails for good it prints a
``ChildFailedError`` summary (root cause: rank, exit code, traceback when the
entry point has ``@record``). :func:`parse_agent` turns one raw line into a
:class:`Line`; :class:`Run` answers questions about a finished job. What a particular
script prints (the training script's losses and resume lines) is read by its lesson
(:mod:`labkit.torchrun.runs`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Line", "Run", "parse_agent", "KEY_MESSAGES"]

_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ (\S+?):\d+\] ?(.*)$")
_TEE = re.compile(r"^\[([A-Za-z_][\w-]*?)(\d+)\]:(.*)$")
_RANKS = re.compile(r"^\s*(local|global)_ranks=\[([\d, ]*)\]")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
KEY_MESSAGES = ("Starting worker group", "Rendezvous complete", "restart_count=",
                "Worker group FAILED", "will restart", "failed (exitcode", "closing signal",
                "successfully finished", "Detected", "Unable to shutdown", "Rendezvous'ing")
_SUMMARY_START = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


@dataclass
class Line:
    """One line of a torchrun job: ``source`` is "agent", "rank" or "notebook"."""

    t: float                 # seconds since the job started
    node: int                # which agent (0 on one node; -1: written by the notebook)
    source: str
    rank: int | None         # global rank of a rank line, when known
    text: str                # without glog header / tee prefix
    level: str = ""          # agent log level I/W/E/F ("" for plain output)
    key: bool = True         # shown by default (rank output, key agent messages, summary)
    local_rank: int | None = None
    nnodes: int = 1

    def shown(self, echo: bool | str) -> bool:
        return echo == "all" or (bool(echo) and self.key)

    def format(self) -> str:
        if self.source == "rank":
            who = (f"rank {self.rank}" if self.rank is not None
                   else f"node{self.node}/local{self.local_rank}")
        elif self.source == "agent":
            who = "agent" if self.nnodes == 1 else f"agent{self.node}"
        else:
            who = self.source
        return f"{self.t:5.1f}s {who:<8} {self.text}"

    def __str__(self) -> str:
        return self.format()


def parse_agent(raw: str, node: int, t: float, state: dict, nnodes: int = 1) -> Line:
    """Parse one raw output line of agent ``node``; ``state`` carries that agent's context."""
    m = _TEE.match(raw)
    if m:
        local = int(m.group(2))
        text = re.sub(r"^\[rank\d+\]:", "", m.group(3))
        rank = state.get("map", {}).get(local, local if nnodes == 1 else None)
        return Line(t, node, "rank", rank, text, local_rank=local, nnodes=nnodes)
    m = _GLOG.match(raw)
    if m:
        level, msg = m.group(1), m.group(3)
        r = _RANKS.match(msg)
        if r:
            ranks = [int(x) for x in r.group(2).split(",") if x.strip()]
            if r.group(1) == "local":
                state["local"] = ranks
            else:
                state["map"] = dict(zip(state.get("local", range(len(ranks))), ranks))
        key = level in "WEF" or any(k in msg for k in KEY_MESSAGES) or (
            nnodes > 1 and r is not None and r.group(1) == "global")
        return Line(t, node, "agent", None, msg.strip() if msg.startswith("  ") else msg, level,
                    key, nnodes=nnodes)
    if raw.startswith(_SUMMARY_START):
        state["summary"] = True
    return Line(t, node, "agent", None, raw, "", bool(state.get("summary")), nnodes=nnodes)


@dataclass
class Run:
    """A finished torchrun job: return codes, every line, and what they say."""

    cmds: list[list[str]]
    returncodes: list[int | None]
    lines: list[Line] = field(repr=False)
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    @property
    def returncode(self) -> int | None:
        return next((rc for rc in self.returncodes if rc != 0), 0)

    def agent_lines(self, node: int = 0) -> list[Line]:
        return [ln for ln in self.lines if ln.source == "agent" and ln.node == node]

    def rank_lines(self, rank: int | None = None) -> list[str]:
        """Text of every rank's output line (or of one global rank), in arrival order."""
        return [ln.text for ln in self.lines
                if ln.source == "rank" and (rank is None or ln.rank == rank)]

    @property
    def attempts(self) -> int:
        """Worker groups started by agent 0 (1 + restarts)."""
        return sum("Starting worker group" in ln.text for ln in self.agent_lines())

    @property
    def restarts(self) -> int:
        return sum("will restart worker group" in ln.text for ln in self.agent_lines())

    @property
    def failures(self) -> list[dict]:
        """Each "failed (exitcode: ...)" the agents logged: t, node, exitcode, local_rank, pid."""
        out = []
        for ln in self.lines:
            m = _FAILED.search(ln.text) if ln.source == "agent" else None
            if m:
                out.append({"t": ln.t, "node": ln.node, "exitcode": int(m.group(1)),
                            "local_rank": int(m.group(2)), "pid": int(m.group(3))})
        return out

    @property
    def summary(self) -> str:
        """torchrun's ``ChildFailedError`` summary ("" when the job did not fail for good)."""
        for node in range(len(self.cmds)):
            text = [ln.text for ln in self.agent_lines(node) if ln.level == ""]
            starts = [i for i, t in enumerate(text) if t.startswith(_SUMMARY_START)]
            if starts:
                body = text[starts[-1]:]
                ends = [i for i, t in enumerate(body) if t.startswith("=====")]
                return "\n".join(body[:ends[-1] + 1] if len(ends) >= 2 else body)
        return ""

    @property
    def root_cause(self) -> dict:
        """The summary's root cause: rank, local_rank, exitcode, error_file, traceback."""
        text = self.summary
        i = text.find("Root Cause")
        if i < 0:
            return {}
        block, out = text[i:], {}
        for name, pat in (("rank", r"rank\s*: (\d+) \(local_rank: (\d+)\)"),
                          ("exitcode", r"exitcode\s*: (-?\d+)"), ("error_file", r"error_file: (.*)")):
            m = re.search(pat, block)
            if m:
                out[name] = m.group(1).strip() if name == "error_file" else int(m.group(1))
                if name == "rank":
                    out["local_rank"] = int(m.group(2))
        m = re.search(r"traceback : (.*?)\n=+", block, re.S)
        out["traceback"] = m.group(1).strip() if m else ""
        return out

    def tail(self, n: int = 15) -> str:
        return "\n".join(ln.format() for ln in self.lines[-n:])

    def log(self, echo: bool | str = True) -> str:
        """The job's lines as printed with ``echo`` (``"all"``: everything)."""
        return "\n".join(ln.format() for ln in self.lines if ln.shown(echo))

    def __repr__(self) -> str:
        return (f"Run(ok={self.ok}, returncodes={self.returncodes}, attempts={self.attempts}, "
                f"restarts={self.restarts}, lines={len(self.lines)}, wall_s={self.wall_s:.1f})")
