"""The lab's text tables: what was measured, as rows, printed under one list of columns.

Every lesson that measures prints the same shape — a few lines saying how it was measured (or
that it is a MODEL PREDICTION), a header, one line per row::

    COLUMNS = [Col("ranks", "world_size", ">5"), Col("size", lambda r: fmt_bytes(r["bytes"]), ">8"),
               Col("time ms", lambda r: r["time_s"] * 1e3, ">9.3f")]
    print(table(COLUMNS, rows, above=["median of the slowest rank"]))

A column is its title, its cell (a key of the row, or a function of the row) and a format spec
(``">9.3f"``, ``"<16"``): the spec's alignment and width place the title too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["Col", "table"]

_SPEC = re.compile(r"^(?:.?[<>^=])?[+\- ]?#?0?(\d*)")


@dataclass(frozen=True)
class Col:
    """One column: ``title``, ``cell`` (a row's key, or a function of the row), ``spec``."""

    title: str
    cell: str | Callable[[dict], Any]
    spec: str = ""

    def head(self) -> str:
        width = _SPEC.match(self.spec).group(1)
        return f"{self.title:{'<' if self.spec.startswith('<') else '>'}{width}}"

    def render(self, row: dict) -> str:
        value = self.cell(row) if callable(self.cell) else row[self.cell]
        return format(value, self.spec)


def table(columns: Iterable[Col], rows: Iterable[dict], *, above: Iterable[str] = (),
          below: Iterable[str] = (), sep: str = " ") -> str:
    """The lines ``above``, the header, one line per row, the lines ``below``."""
    cols = list(columns)
    lines = [*above, sep.join(c.head() for c in cols).rstrip()]
    lines += [sep.join(c.render(r) for c in cols).rstrip() for r in rows]
    return "\n".join([*lines, *below])
