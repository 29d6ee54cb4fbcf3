"""The script torchrun starts for :func:`labkit.torchrun.entry.launch_call`: ``python -m
labkit.torchrun.script CALL.pkl``.

Each worker loads ``(fn, {"args": args})`` (cloudpickle) and calls ``fn(*args)`` as its entry
point, under ``@record`` (:mod:`labkit.portable.elastic`: a failure's traceback goes into
torchrun's summary), then ends as the lab's scripts do (:mod:`labkit.portable.ending`). Nothing
imports this module: runpy would warn that it was imported before it ran.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(path: str) -> None:
    import cloudpickle

    fn, kw = cloudpickle.loads(Path(path).read_bytes())
    fn(*kw["args"])


if __name__ == "__main__":
    from labkit.portable.elastic import record
    from labkit.portable.ending import run_then_exit

    run_then_exit(lambda: record(main)(sys.argv[1]))
