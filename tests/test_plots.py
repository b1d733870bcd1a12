"""The plots draw what was released (noised overflow counts below zero included), show
something for every run, and are drawn again only when their public inputs change."""

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
    counts_ax = fig.axes[2]
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
    _, scale_ax, counts_ax = fig.axes
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


def test_a_language_model_draws_loss_and_perplexity_on_separate_axes():
    """Perplexity is exp(loss): on one panel with two y-axes they drew as one curve."""
    import matplotlib.pyplot as plt

    records = [dict(r, test_loss=2.0 - 0.1 * i) for i, r in enumerate(_records())]
    series = plots.plot_series(records, {"test_perplexity": 3.0})
    fig = plots._utility_figure(plt, series, "t")
    drawn = {ax.get_ylabel(): ax.get_lines() for ax in fig.axes}
    assert set(drawn) == {"test loss", "test perplexity"}
    ((loss,), (ppl,)) = drawn["test loss"], drawn["test perplexity"]
    np.testing.assert_allclose(ppl.get_ydata(), np.exp(loss.get_ydata()))
    plt.close(fig)


def test_a_constant_loss_scale_is_said_and_the_stages_dtypes_are_drawn():
    """The default run (no loss scale, nothing released) drew a flat line over an empty
    panel; now one panel of the policy's dtypes and a line saying what the scale did."""
    import matplotlib.pyplot as plt

    records = [{"step": s, "epsilon": 0.01 * s, "loss_scale": 1.0} for s in (10, 20, 30)]
    report = {
        "steps": 30,
        "policy": "param=f32,compute=bf16,output=f32,grad=bf16,clip=f32,accumulate=f32,noise=f32",
        "loss_scale": {"kind": "none", "history": [[1, 1.0]]},
        "audit": {"ok": True, "counts": {"norm": 3, "noise_add": 1, "all_reduce": 0}},
    }
    fig = plots._precision_figure(plt, plots.plot_series(records, report), "t", report)
    (ax,) = fig.axes
    stages = [t.get_text() for t in ax.get_yticklabels()]
    policy = dict(kv.split("=") for kv in report["policy"].split(","))
    assert stages == list(policy)
    bits = {"f32": 32, "bf16": 16}
    assert [bar.get_width() for bar in ax.patches] == [bits[policy[s]] for s in stages]
    assert "precision audit ok" in ax.get_xlabel() and "all_reduce" not in ax.get_xlabel()
    (line,) = [t.get_text() for t in fig.texts]
    assert "constant 1 for all 30 steps" in line and "no overflow count released" in line
    plt.close(fig)
    # a scale that changed is drawn against steps, below the dtypes
    report["loss_scale"]["history"] = [[1, 1024.0], [21, 2048.0]]
    fig = plots._precision_figure(plt, plots.plot_series(records, report), "t", report)
    assert len(fig.axes) == 3 and list(fig.axes[1].get_lines()[0].get_ydata()) == [1024, 2048, 2048]
    plt.close(fig)


def test_plots_are_drawn_again_only_when_their_public_inputs_change(tmp_path, monkeypatch):
    """What is drawn is tested above; here each figure is a blank one (drawing the real
    ones takes seconds), saved as plot_run saves it, with the inputs' digest."""
    import matplotlib.pyplot as plt

    saved = []

    def blank(*args):
        saved.append(len(saved))
        return plt.figure(figsize=(1, 1))

    monkeypatch.setattr(plots, "_utility_figure", blank)
    monkeypatch.setattr(plots, "_precision_figure", blank)
    lines = [json.dumps(r) for r in _records()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:6]) + "\n")
    paths = plots.plot_run(tmp_path)
    assert [p.name for p in paths] == list(plots.PLOT_FILES) and len(saved) == 2
    assert plots.plots_current(tmp_path)
    drawn = [p.read_bytes() for p in paths]
    # unchanged inputs, and a private file that the plots never read: nothing drawn
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "diagnostics.json").write_text("{}")
    assert plots.plot_run(tmp_path) == paths and len(saved) == 2
    assert [p.read_bytes() for p in paths] == drawn
    # more metrics: both drawn again, with the new digest
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert not plots.plots_current(tmp_path)
    plots.plot_run(tmp_path)
    assert len(saved) == 4 and plots.plots_current(tmp_path)
    # a report written: stale; a plot deleted: both drawn again
    (tmp_path / "report.json").write_text("{}")
    assert not plots.plots_current(tmp_path)
    (tmp_path / "report.json").unlink()
    paths[1].unlink()
    plots.plot_run(tmp_path)
    assert len(saved) == 6 and plots.plots_current(tmp_path)
