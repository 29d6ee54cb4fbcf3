"""The ring all-reduce, replayed from a recorded run: a player you can step through (notebook 03).

Every frame is drawn from a :class:`~labkit.collectives.trace.Trace` recorded on real ranks: the
ranks sit on a ring, each shows the values of its N chunks after the step, the arrows are
the messages of that step (chunk and bytes from the trace), and the title gives the phase
and "step k of 2(N-1)". The naive master approach replays the same way, side by side.

* :func:`player` — an ipywidgets player (play / pause, a step slider, ◀ ▶ buttons).
  Displayed, it also carries a PNG strip of every frame, so where widgets cannot render
  (nbval, a static HTML export, GitHub) the strip shows instead.
* :func:`strip` — all frames as one matplotlib figure; :func:`draw_frame` — one frame.

Example::

    ring = lk.collectives.record("ring", world_size=4, numel=8)
    naive = lk.collectives.record("naive", world_size=4, numel=8)
    lk.ringviz.player(ring, naive)          # last line of a cell
"""
from __future__ import annotations

import base64
import io
import math

from .trace import Trace

__all__ = ["player", "Player", "strip", "draw_frame", "frame_png", "caption"]

_REDUCED, _CHANGED, _PLAIN, _SENT = "#b2f2bb", "#ffd8a8", "#f1f3f5", "#1c7ed6"


def caption(trace: Trace, step: int) -> str:
    """One line for a frame: algorithm, phase, step k of 2(N-1), bytes and measured time."""
    name = "ring all-reduce" if trace.algorithm == "ring" else f"{trace.algorithm} all-reduce"
    if step == 0:
        return f"{name}, {trace.world_size} ranks: before step 1, each rank holds its own tensor"
    sends = trace.at(step, "send")
    spans = [e for e in trace.at(step) if e.end is not None]
    took = (f", {1e3 * (max(e.end for e in spans) - min(e.start for e in spans)):.2f} ms "
            f"measured" if spans else "")
    moved = sum(e.bytes for e in sends)
    return (f"{name}: step {step} of {trace.steps} ({trace.phase(step)}): {len(sends)} "
            f"message{'s' * (len(sends) != 1)}, {moved} bytes{took}")


def _fmt(values: list) -> str:
    if not values:
        return "–"
    first = f"{values[0]:g}" if isinstance(values[0], float) else str(values[0])
    return first if all(v == values[0] for v in values) else first + "…"


def draw_frame(trace: Trace, step: int, ax=None, title: bool = True, scale: float = 1.0):
    """Draw the ring after ``step`` (0 = before the first step) on a matplotlib ``ax``.

    ``scale`` multiplies font sizes (small panels want less than 1).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if not 0 <= step < len(trace.frames):
        raise ValueError(f"step must be 0..{len(trace.frames) - 1} for this trace, got {step}.")
    if ax is None:
        ax = Figure(figsize=(7.2, 5.4), dpi=80).add_subplot()
    n = trace.world_size
    frame, final = trace.frames[step], trace.frames[-1]
    before = trace.frames[step - 1] if step else frame
    sends = trace.at(step, "send") if step else []
    pos = [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]
    width = min(1.6, 1.7 * math.sin(math.pi / n)) if n > 1 else 1.2
    cell = width / n
    for e in sends:                                        # arrows first, under the boxes
        (x0, y0), (x1, y1) = pos[e.rank], pos[e.peer]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle="arc3,rad=0.25",
                                     arrowstyle="-|>", mutation_scale=18 * scale, lw=2 * scale,
                                     color=_SENT, shrinkA=28 * scale, shrinkB=28 * scale,
                                     zorder=1))
        mx, my = (x0 + x1) / 2 + 0.25 * (y1 - y0) / 2, (y0 + y1) / 2 - 0.25 * (x1 - x0) / 2
        label = f"{'all' if e.chunk is None else f'c{e.chunk}'}\n{e.bytes} B"
        ax.text(mx, my, label, ha="center", va="center", fontsize=8 * scale, color=_SENT, zorder=4,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    sent = {(e.rank, e.chunk) for e in sends}
    for r, (x, y) in enumerate(pos):
        ax.text(x, y + 0.16, f"rank {r}", ha="center", va="bottom", fontsize=10 * scale,
                weight="bold", zorder=3)
        for c in range(n):
            cx = x - width / 2 + c * cell
            vals = frame[r][c]
            color = (_REDUCED if vals == final[r][c] and trace.chunk_numels[c] else
                     _CHANGED if vals != before[r][c] else _PLAIN)
            hot = (r, c) in sent or (r, None) in sent
            ax.add_patch(Rectangle((cx, y - 0.1), cell, 0.22, fc=color, zorder=2,
                                   ec=_SENT if hot else "#868e96", lw=2.5 if hot else 0.8))
            ax.text(cx + cell / 2, y + 0.01, _fmt(vals), ha="center", va="center", zorder=3,
                    fontsize=scale * max(5.0, min(9.0, 36 / n)))
            ax.text(cx + cell / 2, y - 0.16, f"c{c}", ha="center", va="center", fontsize=6 * scale,
                    color="#495057", zorder=3)
    ax.set_xlim(-1.8, 1.8)
    ax.set_ylim(-1.4, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(_wrap(caption(trace, step)), fontsize=9)
    return ax


def _wrap(text: str, width: int = 70) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(text, width))


def frame_png(trace: Trace, step: int) -> bytes:
    """One frame as PNG bytes."""
    ax = draw_frame(trace, step)
    ax.figure.text(0.5, 0.02, "green: fully reduced   orange: changed this step   "
                   "blue: sent this step", ha="center", fontsize=7, color="#495057")
    return _png(ax.figure)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def strip(*traces: Trace, cols: int = 4):
    """Every frame of each trace as small multiples (one figure): the static version."""
    from matplotlib.figure import Figure
    if not traces or not all(isinstance(t, Trace) for t in traces):
        raise TypeError("strip() needs one or more Trace objects from lk.collectives.record(...).")
    panels = [(t, k) for t in traces for k in range(len(t.frames))]
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows), dpi=72)
    for i, (t, k) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        draw_frame(t, k, ax, title=False, scale=0.55)
        head = f"{t.algorithm}: " + ("start" if k == 0 else f"step {k}/{t.steps} {t.phase(k)}")
        ax.set_title(head, fontsize=8)
    fig.tight_layout()
    return fig


class Player:
    """Widgets that replay one or more traces step by step (see :func:`player`).

    Attributes (for tests and custom layouts): ``play``, ``slider``, ``prev``, ``next``,
    ``images`` (one ``ipywidgets.Image`` per trace), ``label``, ``widget`` (the whole box).
    """

    def __init__(self, *traces: Trace, interval_ms: int = 1200) -> None:
        import ipywidgets as w
        if not traces or not all(isinstance(t, Trace) for t in traces):
            raise TypeError("player() needs Trace objects, e.g. "
                            "lk.ringviz.player(lk.collectives.record('ring', 4)).")
        if len({t.steps for t in traces}) != 1:
            raise ValueError(f"traces to play together need the same number of steps, got "
                             f"{[t.steps for t in traces]}: record them with the same world_size.")
        self.traces, self.steps = traces, traces[0].steps
        self._cache: dict[tuple[int, int], bytes] = {}
        self.play = w.Play(min=0, max=self.steps, step=1, interval=interval_ms,
                           description="play")
        self.slider = w.IntSlider(min=0, max=self.steps, description="step")
        self.prev = w.Button(description="◀", layout=w.Layout(width="40px"), tooltip="step back")
        self.next = w.Button(description="▶", layout=w.Layout(width="40px"), tooltip="step on")
        w.link((self.play, "value"), (self.slider, "value"))
        self.prev.on_click(lambda _: self._move(-1))
        self.next.on_click(lambda _: self._move(+1))
        share = f"{100 // len(traces) - 1}%"        # side by side, scaled to the output width
        self.images = [w.Image(format="png", layout=w.Layout(width=share, height="auto"))
                       for _ in traces]
        self.label = w.HTML()
        self.slider.observe(self._on_step, names="value")
        self._on_step({"new": 0})
        self.widget = w.VBox([w.HBox([self.play, self.prev, self.slider, self.next]),
                              self.label, w.HBox(self.images, layout=w.Layout(width="100%"))])

    def _move(self, delta: int) -> None:
        self.slider.value = max(0, min(self.steps, self.slider.value + delta))

    def _on_step(self, change: dict) -> None:
        step = change["new"]
        for i, (t, img) in enumerate(zip(self.traces, self.images)):
            if (i, step) not in self._cache:
                self._cache[(i, step)] = frame_png(t, step)
            img.value = self._cache[(i, step)]
        self.label.value = "<br>".join(caption(t, step) for t in self.traces)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The widget for JupyterLab, with a PNG strip for places that cannot run widgets."""
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["image/png"] = base64.b64encode(_png(strip(*self.traces))).decode()
        bundle["text/plain"] = " | ".join(repr(t) for t in self.traces)
        return bundle


def player(*traces: Trace, interval_ms: int = 1200) -> Player:
    """A step-by-step player of recorded all-reduce runs (ring, naive, your own).

    Several traces (same world size) play side by side under one slider.
    """
    return Player(*traces, interval_ms=interval_ms)
