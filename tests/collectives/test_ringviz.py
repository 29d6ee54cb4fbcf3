"""The ring player (labkit.collectives.player): frames from a real trace, widget callbacks without a kernel."""
from __future__ import annotations

import base64

import pytest

import labkit as lk
from labkit.collectives import player as ringviz

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traces():
    ring = lk.collectives.record("ring", world_size=3, numel=7, backend="gloo")
    naive = lk.collectives.record("naive", world_size=3, numel=7, backend="gloo")
    return ring, naive


@pytest.mark.timeout(120)
def test_player_steps_through_the_trace(traces):
    ring, naive = traces
    p = ringviz.player(ring, naive)
    assert (p.slider.min, p.slider.max, p.play.max) == (0, 4, 4)
    assert "before step 1" in p.label.value
    assert all(bytes(im.value).startswith(PNG) for im in p.images)
    first = [bytes(im.value) for im in p.images]
    p.slider.value = 2
    moved = sum(ring.sent(r, 2) for r in range(3))
    want = f"step 2 of 4 (reduce-scatter): 3 messages, {moved} bytes"
    assert want in p.label.value, p.label.value
    assert "naive all-reduce: step 2 of 4 (reduce): 1 message, 28 bytes" in p.label.value
    assert [bytes(im.value) for im in p.images] != first
    p.next.click()
    assert p.slider.value == 3 and "step 3 of 4 (all-gather)" in p.label.value
    p.next.click(), p.next.click()
    assert p.slider.value == 4                      # stops at the last step
    p.play.value = 1                                # the play button drives the slider
    assert p.slider.value == 1 and "step 1 of 4" in p.label.value
    p.prev.click(), p.prev.click()
    assert p.slider.value == 0


def test_display_bundle_has_the_widget_and_a_png_strip(traces):
    bundle = ringviz.player(traces[0])._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(PNG)
    assert "Trace(ring, 3 ranks" in bundle["text/plain"]


def test_frame_draws_one_arrow_per_message_and_colours_reduced_chunks(traces):
    from matplotlib.patches import FancyArrowPatch, Rectangle
    ring, naive = traces
    ax = ringviz.draw_frame(ring, 3)
    arrows = [a for a in ax.patches if isinstance(a, FancyArrowPatch)]
    assert len(arrows) == len(ring.at(3, "send")) == 3
    labels = {t.get_text() for t in ax.texts}
    assert {f"c{e.chunk}\n{e.bytes} B" for e in ring.at(3, "send")} <= labels
    cells = [r for r in ringviz.draw_frame(ring, ring.steps).patches if isinstance(r, Rectangle)]
    assert len(cells) == 9 and all(c.get_facecolor()[:3] == pytest.approx((0.698, 0.949, 0.733),
                                                                          abs=0.01) for c in cells)
    first = [r for r in ringviz.draw_frame(ring, 0).patches if isinstance(r, Rectangle)]
    assert not any(c.get_facecolor()[:3] == cells[0].get_facecolor()[:3] for c in first)
    ax = ringviz.draw_frame(naive, 1)
    assert "all\n28 B" in {t.get_text() for t in ax.texts}


def test_strip_has_every_frame(traces):
    fig = ringviz.strip(*traces)
    assert len(fig.axes) == len(traces[0].frames) + len(traces[1].frames) == 10
    assert fig.axes[0].get_title() == "ring: start"
    assert fig.axes[-1].get_title() == "naive: step 4/4 broadcast"


def test_bad_input_names_the_fix(traces):
    with pytest.raises(ValueError, match="step must be 0..4"):
        ringviz.draw_frame(traces[0], 5)
    with pytest.raises(TypeError, match="record"):
        ringviz.player([1, 2])
    short = lk.collectives.record("ring", world_size=2, numel=4, backend="gloo")
    with pytest.raises(ValueError, match="same number of steps"):
        ringviz.player(traces[0], short)
