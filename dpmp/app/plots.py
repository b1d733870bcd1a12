"""PNG plots of a run directory, drawn from its public files only.

``plot_run(run_dir)`` reads ``metrics.jsonl`` (and ``report.json`` when there),
never ``private/``, and writes:

* ``privacy_utility.png`` — on the held-out split against epsilon spent, the
  test loss in one panel and, in a second, the test accuracy (next-token
  data: the test perplexity, which as ``exp(loss)`` would draw over the loss
  on a shared panel);
* ``precision.png`` — the dtype of each stage of the step (the run's policy,
  with the precision audit's verdict), then what the loss scale did: the
  scale against steps, changing at the steps ``report.json``'s history gives,
  and, for a private dynamic loss scale, every released noised overflow count
  (noise included: they can be negative). A scale that never changed and
  released nothing is said in one line, not drawn as a flat line.

Each PNG records a digest of the files it was drawn from (a PNG text chunk);
``plot_run`` draws again only when a plot is missing or its inputs changed, so
``dpmp report`` leaves a run directory's plots as they are.

``plot_series(records)`` returns exactly the numbers the plots draw.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

from dpmp.app import run_dir as run_dir_lib

__all__ = [
    "PLOT_FILES",
    "inputs_digest",
    "plot_run",
    "plot_series",
    "plots_current",
    "read_metrics",
]

PLOT_FILES = ("privacy_utility.png", "precision.png")
# The inputs the plots are drawn from, and the layout's version (a new layout redraws).
_INPUTS = ("metrics.jsonl", "report.json")
_LAYOUT = b"dpmp plots 2"
_DIGEST_KEY = "dpmp-inputs-sha256"
# The policy's stages, top to bottom, and the width of each dtype it may name.
_STAGES = ("param", "compute", "output", "grad", "clip", "accumulate", "noise")
_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}


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


def _title(run_dir: Path, report: dict | None) -> str:
    title = run_dir.name
    if report is not None:
        try:
            from dpmp.app.release import epsilon_text

            compute = _policy(report).get("compute", "?")
            eps = epsilon_text(report.get("epsilon", 0))
            title = f"{run_dir.name} (compute {compute}, eps {eps})"
            if report.get("private") is False:
                title += " — NOT DP"
        except (AttributeError, TypeError, ValueError):
            pass
    return title


def _policy(report: dict | None) -> dict[str, str]:
    """``{stage: dtype}`` from the report's policy string (``param=f32,...``)."""
    text = str((report or {}).get("policy", ""))
    return dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)


# -- the inputs' digest -------------------------------------------------------------------------


def inputs_digest(run_dir: str | Path) -> str:
    """SHA-256 of the public files the plots are drawn from (and of the layout's
    version): two runs of ``plot_run`` on the same digest draw the same plots."""
    h = hashlib.sha256(_LAYOUT)
    for name in _INPUTS:
        path = Path(run_dir) / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def _recorded_digest(path: Path) -> str | None:
    """The digest a PNG written by ``plot_run`` records (its tEXt chunk), or None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos = 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"tEXt" and body.startswith(_DIGEST_KEY.encode() + b"\0"):
            return body.split(b"\0", 1)[1].decode("latin-1")
        if kind in (b"IDAT", b"IEND"):
            return None
        pos += 12 + length
    return None


def plots_current(run_dir: str | Path, digest: str | None = None) -> bool:
    """Whether every plot exists and was drawn from the run's present files."""
    run_dir = Path(run_dir)
    digest = digest or inputs_digest(run_dir)
    return all(_recorded_digest(run_dir / name) == digest for name in PLOT_FILES)


# -- drawing ------------------------------------------------------------------------------------


def plot_run(run_dir: str | Path, *, redraw: bool = False) -> list[Path]:
    """The run's PNG plots, drawn when one is missing or its inputs changed (or
    with ``redraw``); returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    digest = inputs_digest(run_dir)
    paths = [run_dir / name for name in PLOT_FILES]
    if not redraw and plots_current(run_dir, digest):
        return paths

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = _read_report(run_dir)
    series = plot_series(records, report)
    title = _title(run_dir, report)
    figures = (_utility_figure(plt, series, title), _precision_figure(plt, series, title, report))
    for fig, path in zip(figures, paths, strict=True):
        _save(plt, fig, path, digest)
    return paths


def _save(plt, fig, path: Path, digest: str = "") -> Path:
    """Writes ``fig`` to ``path``; an ``OSError`` (a read-only folder) names the file."""
    try:
        with run_dir_lib.naming(path, "the plot"):
            fig.savefig(path, dpi=110, metadata={_DIGEST_KEY: digest} if digest else None)
    finally:
        plt.close(fig)
    return path


def _utility_figure(plt, series, title):
    """Test loss, then test accuracy (or perplexity), against epsilon: two panels."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.4), sharex=True)
    eps, loss = series["test_loss"]
    top.plot(eps, loss, "o-", color="tab:blue", markersize=4)
    top.set_ylabel("test loss")
    if "test_perplexity" in series:  # next-token data: the measure of a language model
        eps, ppl = series["test_perplexity"]
        bottom.plot(eps, ppl, "s-", color="tab:green", markersize=4)
        bottom.set_ylabel("test perplexity")
    else:
        eps, acc = series["test_accuracy"]
        bottom.plot(eps, acc, "s-", color="tab:green", markersize=4)
        bottom.set_ylabel("test accuracy")
        bottom.set_ylim(0, 1)
    if not eps:
        top.text(0.5, 0.5, "no held-out evaluation was logged", ha="center",
                 va="center", transform=top.transAxes)  # fmt: skip
    bottom.set_xlabel("epsilon spent")
    top.set_title(f"privacy and utility (held-out test split) — {title}", fontsize=10)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _scale_line(series, report: dict | None) -> str:
    """One line for a loss scale that never changed and released nothing."""
    _, scale = series["loss_scale"]
    kind = ((report or {}).get("loss_scale") or {}).get("kind")
    steps = (report or {}).get("steps")
    value = f"{scale[0]:g}" if scale else "?"
    over = f" for all {steps} steps" if steps else ""
    named = f" ('{kind}')" if kind else ""
    return f"loss scale{named}: constant {value}{over}; no overflow count released"


def _varies(series) -> bool:
    return len(set(series["loss_scale"][1])) > 1 or bool(series["noised_overflow"][1])


def _precision_figure(plt, series, title, report: dict | None = None):
    """The stages' dtypes, then the loss scale and the released overflow counts
    against steps, when the scale changed or counts were released."""
    if not _varies(series):
        fig, dtypes = plt.subplots(1, 1, figsize=(7, 3.4))
        _dtype_panel(dtypes, report)
        dtypes.set_title(f"precision of each stage — {title}", fontsize=10)
        fig.text(0.5, 0.02, _scale_line(series, report), ha="center", fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        return fig
    fig, (dtypes, a1, a2) = plt.subplots(
        3, 1, figsize=(7, 7.4), gridspec_kw={"height_ratios": [1.1, 1, 1]}
    )
    _dtype_panel(dtypes, report)
    dtypes.set_title(f"precision of each stage and the loss scale — {title}", fontsize=10)
    a1.sharex(a2)
    steps, scale = series["loss_scale"]
    a1.step(steps, scale, where="post", color="tab:purple")
    a1.set_yscale("log", base=2)
    a1.set_ylabel("loss scale")
    a1.grid(alpha=0.3)
    a1.tick_params(labelbottom=False)
    steps, noised = series["noised_overflow"]
    if noised:
        # as released, negative ones included (no legend: it would cover points)
        a2.plot(steps, noised, ".", color="tab:orange", label="released noised count")
        a2.axhline(0, color="grey", linewidth=0.8)
    else:
        a2.text(0.5, 0.5, "no overflow count is released by this loss scale",
                ha="center", va="center", transform=a2.transAxes)  # fmt: skip
    a2.set_xlabel("step")
    a2.set_ylabel("released noised\noverflow count")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _dtype_panel(ax, report: dict | None) -> None:
    """One bar per stage of the policy, as wide as its dtype's bits; half
    precision in orange. The audit's verdict (public: sites checked) below."""
    policy = _policy(report)
    stages = [s for s in _STAGES if s in policy]
    if not stages:
        ax.text(0.5, 0.5, "no policy in report.json", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        ax.set_axis_off()
        return
    bits = [_BITS.get(policy[s], 0) for s in stages]
    colors = ["tab:orange" if b and b < 32 else "tab:blue" for b in bits]
    ax.barh(range(len(stages)), bits, color=colors, height=0.6)
    for i, (stage, b) in enumerate(zip(stages, bits, strict=True)):
        ax.text(b + 0.6, i, policy[stage], va="center", fontsize=8)
    ax.set_yticks(range(len(stages)), stages)
    ax.invert_yaxis()
    ax.set_xlim(0, 72)
    ax.set_xticks([0, 16, 32, 64])
    label = "bits (orange: half precision)"
    audit = (report or {}).get("audit")
    if isinstance(audit, dict) and "ok" in audit:
        sites = ", ".join(f"{k} {v}" for k, v in (audit.get("counts") or {}).items() if v)
        label += f"\nprecision audit {'ok' if audit['ok'] else 'FAILED'}"
        label += f" (sites checked: {sites})" if sites else ""
    ax.set_xlabel(label, fontsize=8)
    ax.grid(alpha=0.3, axis="x")
