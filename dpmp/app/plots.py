"""PNG plots of a run directory, drawn from its public files only.

``plot_run(run_dir)`` reads ``metrics.jsonl`` (and ``report.json`` when there),
never ``private/``, and writes:

* ``privacy_utility.png`` — test loss and test accuracy (next-token data:
  test perplexity) on the held-out split against epsilon spent;
* ``precision.png`` — the loss scale against steps, changing at the steps
  ``report.json``'s history gives, and, for a private dynamic loss scale, every
  released noised overflow count (noise included: they can be negative).

``plot_series(records)`` returns exactly the numbers the plots draw.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpmp.app import run_dir as run_dir_lib

__all__ = ["plot_run", "plot_series", "read_metrics"]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``; an error if there are none."""
    records = run_dir_lib.read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics.jsonl records; is it a dpmp run directory?")
    return records


def _series(records, x_key, y_key) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(y_key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r[x_key])
            ys.append(v)
    return xs, ys


def plot_series(
    records: list[dict], report: dict | None = None
) -> dict[str, tuple[list[float], list[float]]]:
    """``{name: (xs, ys)}``: every series the plots draw, from public records and,
    when given, the run's ``report.json``: its loss-scale history (the exact steps
    of each change, where the records only see logged steps), every released
    noised count, and for next-token data the test perplexity."""
    series = {
        "test_loss": _series(records, "epsilon", "test_loss"),
        "test_accuracy": _series(records, "epsilon", "test_accuracy"),
        "loss_scale": _series(records, "step", "loss_scale"),
        "noised_overflow": _series(records, "step", "noised_overflow"),
    }
    report = report if isinstance(report, dict) else {}
    history = (report.get("loss_scale") or {}).get("history")
    if history:
        last = max(int(report.get("steps") or 0), history[-1][0])
        series["loss_scale"] = (
            [s for s, _ in history] + [last],
            [v for _, v in history] + [history[-1][1]],
        )
    counts = (report.get("overflow") or {}).get("noised_counts")
    if counts:
        first = int(report.get("steps") or len(counts)) - len(counts) + 1
        series["noised_overflow"] = (list(range(first, first + len(counts))), list(counts))
    if report.get("test_perplexity") is not None:
        eps, loss = series["test_loss"]
        series["test_perplexity"] = (eps, [math.exp(v) for v in loss])
    return series


def _read_report(run_dir: Path) -> dict | None:
    """The run's report.json, or None when absent or unreadable."""
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) else None


def _title(run_dir: Path) -> str:
    title = run_dir.name
    report = _read_report(run_dir)
    if report is not None:
        try:
            from dpmp.app.release import epsilon_text

            compute = dict(
                kv.split("=", 1) for kv in str(report.get("policy", "")).split(",") if "=" in kv
            ).get("compute", "?")
            eps = epsilon_text(report.get("epsilon", 0))
            title = f"{run_dir.name} (compute {compute}, eps {eps})"
            if report.get("private") is False:
                title += " — NOT DP"
        except (AttributeError, TypeError, ValueError):
            pass
    return title


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes the run's PNG plots and returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    series = plot_series(read_metrics(run_dir), _read_report(run_dir))
    title = _title(run_dir)
    out = []

    # test loss and accuracy against epsilon
    fig, ax = plt.subplots(figsize=(7, 4.2))
    eps, loss = series["test_loss"]
    ax.plot(eps, loss, "o-", color="tab:blue", label="test loss", markersize=4)
    ax.set_xlabel("epsilon spent")
    ax.set_ylabel("test loss", color="tab:blue")
    ax2 = ax.twinx()
    if "test_perplexity" in series:  # next-token data: the measure of a language model
        eps, ppl = series["test_perplexity"]
        ax2.plot(eps, ppl, "s-", color="tab:green", label="test perplexity", markersize=4)
        ax2.set_ylabel("test perplexity", color="tab:green")
    else:
        eps, acc = series["test_accuracy"]
        ax2.plot(eps, acc, "s-", color="tab:green", label="test accuracy", markersize=4)
        ax2.set_ylabel("test accuracy", color="tab:green")
        ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="center right")
    ax.set_title(f"privacy and utility (held-out test split) — {title}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.append(_save(plt, fig, run_dir / "privacy_utility.png"))
    out.append(_save(plt, _precision_figure(plt, series, title), run_dir / "precision.png"))
    return out


def _save(plt, fig, path: Path) -> Path:
    """Writes ``fig`` to ``path``; an ``OSError`` (a read-only folder) names the file."""
    try:
        with run_dir_lib.naming(path, "the plot"):
            fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _precision_figure(plt, series, title):
    """The loss scale and the released noised overflow counts against steps.

    The counts are drawn as released, noise included: a negative count is a
    point below the zero line, never cut off at 0 (which would make the noise
    look biased).
    """
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    steps, scale = series["loss_scale"]
    a1.step(steps, scale, where="post", color="tab:purple")
    a1.set_yscale("log", base=2)
    a1.set_ylabel("loss scale")
    a1.grid(alpha=0.3)
    a1.set_title(f"loss scale and released overflow counts — {title}", fontsize=10)
    steps, noised = series["noised_overflow"]
    if noised:
        # no legend (it would cover points): the axis label says what they are
        a2.plot(steps, noised, ".", color="tab:orange", label="released noised count")
        a2.axhline(0, color="grey", linewidth=0.8)
    else:
        a2.text(
            0.5,
            0.5,
            "no overflow count is released by this loss scale",
            ha="center",
            va="center",
            transform=a2.transAxes,
        )
    a2.set_xlabel("step")
    a2.set_ylabel("released noised\noverflow count")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    return fig
