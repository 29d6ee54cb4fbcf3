"""Progress bars: a widget bar in JupyterLab, a text bar in a terminal, none when asked."""
from __future__ import annotations

from typing import Iterable

__all__ = ["progress"]


def progress(items: Iterable | None = None, *, show: bool = True, total: int | None = None,
             desc: str = "", unit: str = "it"):
    """``tqdm.auto`` over ``items`` (or a manual bar of ``total``), or a silent one."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc or None, unit=unit, leave=False, disable=not show)
