"""Reading one rank's evidence (status, error, traceback, live stack) as a :class:`RankFinding`.

Used by :mod:`labkit.diagnosis.diagnose`. A rank that raised is classified by its error
text: an **echo** (a peer's connection closed or reset: the rank only saw
another rank fail), a **timeout** (it waited in a collective past the
process-group timeout), or its own error. The collective it was in is the
outermost ``torch.distributed`` frame of its traceback or stack dump (or DDP's
gradient all-reduce inside ``backward``); its own line of code is the innermost
frame outside torch.
"""
from __future__ import annotations

import os
import re

from ..runtime.result import RankResult, error_kind
from ..runtime.stacks import Frame, parse_stack, where_stuck
from .verdict import RankFinding

__all__ = ["finding", "tb_frames", "short_error"]

_TORCH = os.sep + "torch" + os.sep
_TB_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<func>.+)$')


def tb_frames(tb: str) -> list[Frame]:
    """Frames of a formatted traceback, innermost first (the order of a stack dump)."""
    out = [Frame(m["file"], int(m["line"]), m["func"])
           for m in map(_TB_FRAME.match, (tb or "").splitlines()) if m]
    return out[::-1]


def _collective(frames: list[Frame]) -> str | None:
    """The torch.distributed call (or DDP's backward) a rank was inside."""
    c10d = [f.func for f in frames if f.file.endswith("distributed_c10d.py")]  # innermost first
    if c10d:
        return c10d[-1]
    if any(f.func in ("backward", "_engine_run_backward") and _TORCH in f.file for f in frames):
        return "backward (DDP's gradient all_reduce)"
    return None


def finding(r: RankResult) -> RankFinding:
    """What one rank did, where, and in which collective (see :class:`RankFinding`)."""
    if r.status == "ok":
        return RankFinding(r.rank, "ok", f"returned {r.value!r:.60}")
    if r.status == "hung":
        frames = parse_stack(r.stack or "")
        return RankFinding(r.rank, "hung", "still running at the deadline", _collective(frames),
                           _strip_collective(r.where or where_stuck(frames)), _user_at(frames))
    if r.status in ("exited", "signaled"):
        frames = parse_stack(r.stderr or "")
        return RankFinding(r.rank, "crashed", short_error(r.describe().split(" ", 2)[2], 200),
                           _collective(frames), _strip_collective(where_stuck(frames))
                           if frames else None, _user_at(frames))
    frames = tb_frames(r.traceback or "")
    err = (r.error or "").strip()
    return RankFinding(r.rank, error_kind(err), short_error(err), _collective(frames),
                       _user_where(frames, _tb_sources(r.traceback or "")), _user_at(frames))


def _user_at(frames: list[Frame]) -> tuple[str, int] | None:
    user = next((f for f in frames if _TORCH not in f.file), None)
    return (user.file, user.line) if user else None


def _strip_collective(where: str | None) -> str | None:
    """'all_reduce, called from step (line 5: ...)' -> 'step (line 5: ...)'."""
    if where and ", called from " in where:
        return where.split(", called from ", 1)[1]
    return where


def _tb_sources(tb: str) -> dict[tuple[str, int], str]:
    """(file, line) -> the source line a traceback printed under that frame."""
    lines, out = tb.splitlines(), {}
    for i, line in enumerate(lines[:-1]):
        m = _TB_FRAME.match(line)
        if m and not _TB_FRAME.match(lines[i + 1]) and lines[i + 1].startswith("    "):
            out[(m["file"], int(m["line"]))] = lines[i + 1].strip()
    return out


def _user_where(frames: list[Frame], sources: dict | None = None) -> str | None:
    user = next((f for f in frames if _TORCH not in f.file), None)
    if user is None:
        return None
    src = user.source or (sources or {}).get((user.file, user.line), "")
    return f"{user.func} (line {user.line}: {src})" if src else \
        f"{user.func} ({os.path.basename(user.file)}:{user.line})"


def short_error(err: str, n: int = 160) -> str:
    err = err.splitlines()[0] if err else err
    err = re.sub(r"\[(enforce fail at )?/[^\]]*\] ", "", err).replace("what():  ", "")
    return err if len(err) <= n else err[:n - 3] + "..."
