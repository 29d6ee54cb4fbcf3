"""The lab's own answers: an exercise answer that hands the work to one fails.

The lessons hold reference implementations of what their exercises ask
(``lk.collectives.ring_all_reduce``, ``lk.ddp.average_gradients`` ...): an answer that calls
one has the library do the work. Each is marked with :func:`reference`, which counts its calls
in the process; a checker runs the answer inside :func:`references_used` (in the rank) and fails
a case that called one, naming it. Aliases and closures reach the same counted function (the
lesson module's attribute is the counting wrapper); copying a reference's source into the
answer is writing it out, and is not caught. No torch here: lessons import this at import time.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

__all__ = ["reference", "references_used", "reference_problem"]

_CALLS: dict[str, int] = {}     # this process: reference name -> calls so far


def reference(fn):
    """Mark ``fn`` as a lesson's own implementation of what an exercise asks: its calls are
    counted (:func:`references_used`). The wrapper keeps ``fn``'s module, name, docstring and
    signature, so it pickles by reference and reads like ``fn`` in ``help()``; it keeps no
    ``__wrapped__`` (that would hand an answer the uncounted function)."""
    name = f"{fn.__module__}.{fn.__qualname__}"

    def counted(*args, **kwargs):
        _CALLS[name] = _CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(counted, attr, getattr(fn, attr))
    counted.__signature__ = inspect.signature(fn)
    return counted


def reference_problem(names) -> str | None:
    """A case's failure detail when the answer called the references ``names``, else None."""
    if not names:
        return None
    listed = ", ".join(f"lk's {n.removeprefix('labkit.')}" for n in sorted(set(names)))
    return (f"the lab's own implementation did the work ({listed} ran inside your answer): "
            f"the exercise is to write that yourself")


@contextmanager
def references_used(*prefixes: str):
    """Which :func:`reference` functions whose names start with one of ``prefixes`` ran in the
    block, in this process (threads included). An exercise forbids what does its own work and
    no more (06's ZeRO-3 layer is built from the ring halves that 03's exercise may not use)::

        with references_used("labkit.ddp.") as used:
            answer(model)
        reference_problem(used)     # None, or why the case fails
    """
    before, used = dict(_CALLS), []
    try:
        yield used
    finally:
        used[:] = sorted(n for n, k in _CALLS.items()
                         if k > before.get(n, 0) and n.startswith(prefixes))
