"""PNG plots of a run directory: what people would rather look at than read.

``plot_run(run_dir)`` reads ``metrics.jsonl`` (and ``report.json`` when there)
and writes:

* ``privacy_utility.png`` — training loss and test accuracy against epsilon spent;
* ``precision.png`` — loss scale and overflowed examples (this step, and the
  privatized release where the scale is private) against steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpmp._src import run_dir as run_dir_lib

__all__ = ["plot_run", "read_metrics"]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``; an error if there are none."""
    records = run_dir_lib.read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics.jsonl records; is it a dpmp run directory?")
    return records


def _series(records, key):
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v)):
            xs.append(r)
            ys.append(v)
    return xs, ys


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes the run's PNG plots and returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    title = run_dir.name
    report_path = run_dir / "report.json"
    if report_path.is_file():
        try:
            report = json.loads(report_path.read_text())
            compute = dict(
                kv.split("=", 1) for kv in str(report.get("policy", "")).split(",") if "=" in kv
            ).get("compute", "?")
            title = f"{run_dir.name} (compute {compute}, eps {report.get('epsilon', 0):.3g})"
        except json.JSONDecodeError:
            pass
    out = []

    # loss and accuracy against epsilon
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rec, loss = _series(records, "loss")
    ax.plot([r["epsilon"] for r in rec], loss, color="tab:blue", label="training loss")
    ax.set_xlabel("epsilon spent")
    ax.set_ylabel("training loss", color="tab:blue")
    ax2 = ax.twinx()
    for key, style in (("test_accuracy", "o-"), ("train_accuracy", "s--")):
        rec, acc = _series(records, key)
        if acc:
            ax2.plot(
                [r["epsilon"] for r in rec],
                acc,
                style,
                color="tab:green",
                label=key.replace("_", " "),
                markersize=4,
            )
    ax2.set_ylabel("accuracy", color="tab:green")
    ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="center right")
    ax.set_title(f"privacy and utility — {title}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "privacy_utility.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)

    # loss scale and overflow against steps
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    rec, scale = _series(records, "loss_scale")
    a1.step([r["step"] for r in rec], scale, where="post", color="tab:purple")
    a1.set_yscale("log", base=2)
    a1.set_ylabel("loss scale")
    a1.grid(alpha=0.3)
    a1.set_title(f"loss scale and overflow — {title}", fontsize=10)
    rec, over = _series(records, "overflow")
    a2.bar([r["step"] for r in rec], over, color="tab:red", label="overflowed examples (exact)")
    rec, noised = _series(records, "noised_overflow")
    if noised:
        a2.plot(
            [r["step"] for r in rec], noised, ".", color="tab:orange", label="released noised count"
        )
    a2.set_xlabel("step")
    a2.set_ylabel("examples")
    a2.set_ylim(bottom=0, top=max([1.0, *over, *noised]) * 1.1)
    a2.legend(loc="upper right")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "precision.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)
    return out
