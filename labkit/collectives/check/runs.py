"""What the checkers of notebook 03 read from a finished (or failed) gloo job: did it deadlock,
which rank explains the failure, its error without gloo's source locations, and the flight
recorder's setting for the checker's ranks."""
from __future__ import annotations

import os
import re

from ...runtime.result import error_kind

__all__ = ["HEADER_BYTES", "recorder_env", "stuck", "failure", "clean"]

HEADER_BYTES = 160         # gloo's framing per send/recv pair is 144 bytes (torch 2.13)


def recorder_env() -> dict | None:
    """Turn the flight recorder back on for the checker's ranks if the environment set it."""
    keys = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    return {k: "2000" for k in keys} if any(k in os.environ for k in keys) else None


def stuck(res) -> bool:
    """Did the job deadlock (hung, or a rank's receive timed out)?"""
    return any(r.status == "hung" or "Timed out" in (r.error or "") for r in res.ranks)


def failure(res):
    """The rank whose failure explains the job: a timeout or own error, not a peer's echo."""
    failed = [r for r in res.ranks if not r.ok]
    for good in (lambda r: r.status == "hung" or "Timed out" in (r.error or ""),
                 lambda r: error_kind(r.error or "") != "echo"):
        pick = [r for r in failed if good(r)]
        if pick:
            return pick[0]
    return failed[0] if failed else None


def clean(text: str) -> str:
    """Drop gloo's source locations ("[/__w/.../pair.cc:553] ") from an error message."""
    return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)
