"""Shipping a job to the ranks by value, and values back: cloudpickle with real file names.

``mp.spawn`` children look a function up by name in ``__main__``, which a notebook kernel
cannot offer; cloudpickle ships it by value. Two details make the result teachable: shipped
code keeps its real ``co_filename`` (a notebook cell's too), so a rank's traceback and stack
dump point at the learner's cell, and :func:`with_sources` adds the cell's source lines, which
only the notebook's linecache can see. A value that cannot cross either way gets an error that
names the part, the rank and the type (:func:`pickle_job`, :func:`load_value`).
"""
from __future__ import annotations

import io
import linecache
import re
import types
from collections import ChainMap

import cloudpickle

from .errors import InvalidJob

__all__ = ["dumps", "pickle_job", "load_value", "ValueNotLoadable", "with_sources"]


def _code_reduce_keeping_filename(code):
    # cloudpickle 3 renames every shipped code object "<dynamic-code>"; keep the real
    # file (a notebook cell's too) so tracebacks and stack dumps point at the learner's code.
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename},
                              cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """cloudpickle ``obj``, keeping the real file names of shipped code."""
    with io.BytesIO() as f:
        _Pickler(f).dump(obj)
        return f.getvalue()


_TB_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+), in .+$')


def with_sources(tb: str) -> str:
    """Add the source line under each traceback frame that lacks one.

    A rank cannot see the source of a notebook cell; the kernel's linecache can.
    """
    out, lines = [], tb.splitlines()
    for i, line in enumerate(lines):
        out.append(line)
        m = _TB_FRAME.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m and (not nxt.startswith(m[1] + "  ") or _TB_FRAME.match(nxt)):
            src = linecache.getline(m[2], int(m[3])).strip()
            if src:
                out.append(f"{m[1]}    {src}")
    return "\n".join(out) + "\n"


def pickle_job(fn, args, kwargs) -> bytes:
    """Pickle the job by value, naming the part that cannot be sent."""
    try:
        return dumps((fn, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - find the culprit for the message
        parts = [("the function", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
                [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        for name, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception:  # noqa: BLE001
                raise InvalidJob(
                    f"{name} ({type(obj).__name__}) cannot be sent to the ranks: {exc}. "
                    f"Pass plain values or tensors and create open files, locks, generators "
                    f"or sockets inside the function instead.") from exc
        raise InvalidJob(f"the job cannot be pickled: {exc}") from exc


class ValueNotLoadable(Exception):
    """A rank's value was pickled there but cannot be unpickled here (message says why)."""


def load_value(data: bytes, type_name: str | None) -> object:
    """Unpickle what a rank returned; any failure becomes :class:`ValueNotLoadable`.

    A value can pickle in the rank and still fail here: a class defined only in the rank
    (created inside the function, or in a module the notebook cannot import), a
    ``__reduce__`` that raises on load, a truncated stream.
    """
    try:
        return cloudpickle.loads(data)
    except BaseException as exc:  # noqa: BLE001 - any failure to load is the same lesson
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ValueNotLoadable(
            f"returned a {type_name or 'value'} that was pickled in the rank but cannot be "
            f"unpickled in the notebook ({type(exc).__name__}: {exc})") from exc

