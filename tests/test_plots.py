"""The plots draw what was released: noised overflow counts below zero included."""

import json

import matplotlib
import numpy as np

from dpmp.app import plots

matplotlib.use("Agg")


def _records():
    rng = np.random.default_rng(0)
    noised = rng.normal(0.0, 64.0, size=12)  # a zero true count plus its noise
    noised[3] = -150.0  # a clearly negative release
    return [
        {
            "step": 10 * (i + 1),
            "epsilon": 0.1 * (i + 1),
            "loss_scale": 2.0**15,
            "noised_overflow": v,
        }
        for i, v in enumerate(noised.tolist())
    ]


def test_noised_overflow_counts_are_drawn_as_released_negative_ones_included():
    import matplotlib.pyplot as plt

    records = _records()
    released = [r["noised_overflow"] for r in records]
    assert min(released) < 0
    steps, counts = plots.plot_series(records)["noised_overflow"]
    assert counts == released and steps == [r["step"] for r in records]

    fig = plots._precision_figure(plt, plots.plot_series(records), "t")
    counts_ax = fig.axes[1]
    (line,) = [ln for ln in counts_ax.get_lines() if ln.get_label() == "released noised count"]
    np.testing.assert_array_equal(line.get_ydata(), released)
    low, high = counts_ax.get_ylim()
    assert low <= min(released) and high >= max(released)  # nothing clipped at 0
    plt.close(fig)


def test_plot_run_writes_both_pngs_from_public_files(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in _records():
            f.write(json.dumps(r) + "\n")
    paths = plots.plot_run(tmp_path)
    assert [p.name for p in paths] == ["privacy_utility.png", "precision.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _report(steps: int) -> dict:
    rng = np.random.default_rng(1)
    return {
        "steps": steps,
        "loss_scale": {"history": [[1, 1024.0], [51, 2048.0], [101, 4096.0]]},
        "overflow": {"noised_counts": rng.normal(0.0, 64.0, size=steps).tolist()},
    }


def test_the_loss_scale_changes_where_the_history_says_and_every_count_is_drawn():
    """Records come every log_every steps; the report's history and counts are exact."""
    import matplotlib.pyplot as plt

    records, report = _records(), _report(120)
    series = plots.plot_series(records, report)
    steps, scale = series["loss_scale"]
    assert steps == [1, 51, 101, 120] and scale == [1024.0, 2048.0, 4096.0, 4096.0]
    assert series["noised_overflow"] == (list(range(1, 121)), report["overflow"]["noised_counts"])
    fig = plots._precision_figure(plt, series, "t")
    scale_ax, counts_ax = fig.axes
    drawn = scale_ax.get_lines()[0]
    assert list(drawn.get_xdata()) == steps  # a step plot from the changes' own steps
    (line,) = [ln for ln in counts_ax.get_lines() if ln.get_label() == "released noised count"]
    assert len(line.get_ydata()) == 120
    assert counts_ax.get_legend() is None  # no box over the points
    plt.close(fig)


def test_a_language_model_plots_perplexity(tmp_path):
    records = [dict(r, test_loss=2.0 + 0.1 * i) for i, r in enumerate(_records())]
    series = plots.plot_series(records, {"test_perplexity": 7.4})
    eps, ppl = series["test_perplexity"]
    assert eps == [r["epsilon"] for r in records]
    np.testing.assert_allclose(ppl, np.exp([r["test_loss"] for r in records]))
    assert "test_perplexity" not in plots.plot_series(records, {"test_perplexity": None})
