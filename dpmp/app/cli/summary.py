"""What ``dpmp train`` and ``dpmp report`` print about a run: its public numbers
as a table, and which of its files are safe to publish."""

from __future__ import annotations

__all__ = ["fmt", "inventory", "summary"]


def fmt(value, spec: str = ".4g") -> str:
    """A number as the tables print it: floats with ``spec``, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def inventory(run_dir) -> list[str]:
    """The run directory's files, grouped by whether they may be published."""
    from dpmp.app.release import inventory_lines

    return inventory_lines(run_dir)


def summary(report: dict) -> str:
    """The report's public numbers as a table, and whether the run is private."""
    overflow = report.get("overflow", {}) or {}
    audit = report.get("audit", {}) or {}
    standardize = report.get("standardize") or {}
    rows = [
        ("policy", report.get("policy")),
        (
            "model",
            (report.get("model") or {}).get("kind")
            if isinstance(report.get("model"), dict)
            else report.get("model"),
        ),
        ("steps", report.get("steps")),
        ("test accuracy", fmt(report.get("test_accuracy"))),
        ("test perplexity", fmt(report.get("test_perplexity"))),
        ("epsilon", f"{_epsilon(report.get('epsilon'))} (delta {fmt(report.get('delta'))})"),
        ("noise multiplier", fmt(report.get("noise_multiplier"))),
        ("noised overflow total", fmt(overflow.get("noised_count_total"))),
        ("loss-scale cost (epsilon)", fmt(overflow.get("epsilon_cost"))),
        ("standardize", standardize.get("mode", "-")),
        ("audit", "ok" if audit.get("ok") else ("FAILED" if audit else "-")),
    ]
    if standardize.get("epsilon_cost") is not None:
        rows.append(("standardize cost (epsilon)", fmt(standardize["epsilon_cost"])))
    rows += _starting_point_rows(report)
    rows += _privacy_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _epsilon(value) -> str:
    """The run's epsilon as train.log and the progress bar print it."""
    if not isinstance(value, int | float):
        return fmt(value)
    from dpmp.app.release import epsilon_text

    return epsilon_text(value)


def _starting_point_rows(report: dict) -> list[tuple[str, str]]:
    """Where a fine-tuned run started, and how many parameters it trained."""
    start = report.get("starting_point")
    if not isinstance(start, dict):
        return []
    text = start.get("source", "-")
    if start.get("public_test_perplexity") is not None:
        text += (
            f": {start.get('steps')} steps, held-out public perplexity "
            f"{fmt(start['public_test_perplexity'], '.2f')}"
        )
    return [("started from", text), ("trained parameters", f"{report.get('num_params'):,}")]


def _privacy_rows(report: dict) -> list[tuple[str, str]]:
    """Whether the run is private, why not, and what else its privacy rests on."""
    rows = []
    if report.get("private") is True:
        rows.append(("private", "yes (differentially private; zero-out neighbours)"))
    elif report.get("private") is False:
        rows.append(("private", "NO: this run is NOT differentially private"))
        for warning in report.get("privacy_warnings") or []:
            rows.append(("privacy warning", warning))
    if report.get("privacy_unit") == "user":
        rows.append(
            (
                "privacy unit",
                f"user ({fmt(report.get('num_users'))} users, at most "
                f"{fmt(report.get('user_records'))} records of each "
                + (
                    "kept, each sampled on its own)"
                    if report.get("user_sampling") == "records"
                    else "per step)"
                ),
            )
        )
    elif report.get("privacy_unit"):
        rows.append(("privacy unit", str(report["privacy_unit"])))
    if report.get("stopped_early"):
        rows.append(("stopped early", report["stopped_early"]))
    overflow = report.get("overflow", {}) or {}
    if overflow.get("privacy"):
        rows.append(("loss-scale privacy", overflow["privacy"]))
    note = (report.get("sampling") or {}) if isinstance(report.get("sampling"), dict) else {}
    if note.get("privacy_note"):
        rows.append(("privacy note", note["privacy_note"]))
    return rows
