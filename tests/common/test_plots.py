"""Plots draw what they are given: checked on small hand-made data, no ranks needed."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.common import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _spans(rank, offset=0.0):
    return [{"rank": rank, "lane": "compute", "kind": "forward", "label": "F0",
             "start": offset, "end": offset + 0.01},
            {"rank": rank, "lane": "compute", "kind": "backward", "label": "",
             "start": offset + 0.01, "end": offset + 0.03},
            {"rank": rank, "lane": "comm", "kind": "grads ready", "label": "b0",
             "start": offset + 0.02, "end": offset + 0.02},
            {"rank": rank, "lane": "comm", "kind": "all_reduce", "label": "b0",
             "start": offset + 0.02, "end": offset + 0.04}]


def test_timeline_draws_one_row_per_rank_and_lane_with_every_span():
    fig = plots.timeline([_spans(0), _spans(1, 0.005)], title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == \
        ["rank 0", "rank 0 comm", "rank 1", "rank 1 comm"]
    assert len(ax.patches) == 6                    # 3 bars per rank; the zero-length one is a tick
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == [10.0, 10.0, 20.0, 20.0, 20.0, 20.0]      # milliseconds
    assert {t.get_text() for t in ax.get_legend().get_texts()} == \
        {"forward", "backward", "all_reduce"}


def test_gradient_inspector_shows_locals_average_and_oracle_and_reports_the_difference():
    local = [torch.full((2, 3), float(r)) for r in range(4)]
    avg = torch.full((2, 3), 1.5)
    fig = plots.gradient_inspector(local, [avg] * 4, avg, losses=[2.0, 1.0, 3.0, 4.0], name="w")
    titles = [ax.get_title() for ax in fig.axes[:6]]
    assert titles[0] == "rank 0 local\nloss 2" and "same on all 4 ranks" in titles[4]
    assert "oracle" in titles[5]
    assert "= 0.00e+00" in fig._suptitle.get_text()
    bad = plots.gradient_inspector(local, [avg, avg + 1, avg, avg], avg + 0.5)
    assert "DIFFERS" in bad.axes[4].get_title()
    assert "5.00e-01" in bad._suptitle.get_text()
    bias = plots.gradient_inspector([torch.ones(5)] * 2, [torch.ones(5)] * 2, torch.ones(5))
    assert bias.axes[0].images[0].get_array().shape == (1, 5)


def test_replica_drift_checksums_and_shards_draw_their_data():
    alone = {"checksums": [[1.0, 2.0], [1.0, 3.0]], "distance": [0.0, 1.0]}
    dp = {"checksums": [[1.0, 2.5], [1.0, 2.5]], "distance": [0.0, 0.0]}
    fig = plots.replica_drift(alone, dp)
    assert len(fig.axes[0].lines) == 4 and "1 vs 0" in fig.axes[1].get_title()
    fig = plots.checksums([1.0, 2.0], [1.5, 1.5])
    assert "spread 1" in fig.axes[0].get_title() and "spread 0" in fig.axes[1].get_title()
    fig = plots.shards([[[0, 2, 4], [1, 3, 0]]], dataset_size=5)
    assert len(fig.axes[0].patches) == 6
    assert any(t.get_text() == "×2" for t in fig.axes[0].texts)   # sample 0 handed out twice


def test_bucket_explorer_slider_swaps_recorded_images_and_falls_back_to_a_static_grid():
    runs = {0.0: [_spans(0), _spans(1)], 25.0: [_spans(0, 0.01), _spans(1)]}
    box = plots.bucket_explorer(runs, static=False)
    assert box.image.value == box.images[0.0]
    box.slider.value = 25.0
    assert box.image.value == box.images[25.0] != box.images[0.0]
    grid = plots.bucket_explorer(runs, static=True)
    assert len([a for a in grid.axes if a.get_title()]) == 2
    assert "1 all-reduce per step" in grid.axes[0].get_title()
    # under pytest (as under nbval) the default is the static grid
    assert isinstance(plots.bucket_explorer(runs), plt.Figure)


def test_gradient_inspector_without_oracle_shows_local_gradients_only_and_per_rank_bars():
    fig = plots.gradient_inspector([torch.ones(2, 2), -torch.ones(2, 2)], losses=[1.0, 2.0])
    assert len([a for a in fig.axes if a.images]) == 2
    fig = plots.per_rank([2.0, 1.0, 3.0, 4.0], title="loss")
    assert [round(p.get_height(), 3) for p in fig.axes[0].patches] == [2.0, 1.0, 3.0, 4.0]
    fig = plots.checksums([1.0, 2.0], [1.0, 1.0], labels=("without sync", "with sync"))
    assert fig.axes[0].get_title().startswith("without sync")
