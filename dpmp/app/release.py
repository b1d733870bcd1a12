"""What a run publishes, and what it keeps to itself.

Every number that leaves a run is a release. Each one the trainer writes is
exactly one of:

* **privatized and accounted**: the parameters (noised gradients); with a
  private dynamic loss scale, the noised overflow counts and the loss scale
  they drive (post-processing); with private standardisation, the noised
  feature statistics (kept in checkpoints);
* **computed on the held-out test split**: test accuracy and test loss;
* **part of the public plan**: the config, epsilon, delta, the noise
  multiplier, steps, the number of training records n (public under zero-out
  neighbours, ``dpmp.accounting.NEIGHBOURING_RELATION_NOTE``), the sampling probability and
  padded batch size computed from it, the precision audit and clip method of
  the step (functions of shapes and dtypes, not of values).

Everything else -- the exact batch loss, exact overflow counts and what they
say of the run, the clipped fraction, gradient norms, realised batch sizes and
truncations, train accuracy and loss -- goes only to the run's ``private/``
folder, labelled ``PRIVATE_NOTE`` there (with per-step times beside them; the
progress bar's speed is public: a step's work is fixed by shapes, not by the
records). Exit statuses and warnings are releases too: ``run_failures`` reads
released numbers only, and an audit that could not check the step fails closed.
Checkpoints hold the secret noise keys, the sampler's seed and a fingerprint of
the data: as secret as the data.

    public:   report.json  metrics.jsonl  train.log  *.png  tensorboard/  progress bar
              callback  the caller's actions (dpmp.app.trainer.actions)
    private:  private/metrics.jsonl  private/diagnostics.json  private/README.txt
    secret:   checkpoints/

A run that is not differentially private says so: ``privacy_warnings(...)``
lists why, ``report["private"]`` is False, and the log, the end-of-run summary
and ``dpmp report`` repeat it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import dpmp.accounting as accounting
from dpmp.app.run_dir import LOG_FILE, METRICS_FILE, PRIVATE_DIR, PRIVATE_NOTE, REPORT_FILE
from dpmp.data._sampling import ShuffledSampler
from dpmp.noise._registry import drawn_sampler

__all__ = [
    "PRIVATE_DIR",
    "PRIVATE_NOTE",
    "PRIVATE_README",
    "EXPORTED_PARAMS",
    "PUBLIC_FILES",
    "RUN_FILES",
    "audit_warnings",
    "build_report",
    "config_dict",
    "epsilon_text",
    "file_inventory",
    "inventory_lines",
    "overflow_diagnosis",
    "mesh_summary",
    "private_diagnostics",
    "private_record",
    "privacy_notes",
    "privacy_warnings",
    "progress_fields",
    "public_config",
    "public_info",
    "public_record",
    "report_private",
    "run_failures",
]

# The public files a run writes (the plots: ``dpmp train`` and ``dpmp report``).
RUN_FILES = (REPORT_FILE, METRICS_FILE, LOG_FILE, "privacy_utility.png", "precision.png")
# ``dpmp export`` writes the parameters alone beside them.
EXPORTED_PARAMS = "params.npz"
PUBLIC_FILES = (*RUN_FILES, EXPORTED_PARAMS)
# `dpmp export --format hf [--merge]`'s folders in the run (released parameters, the
# public checkpoint's files, privacy.json): public once they hold an export's privacy.json.
EXPORTED_FOLDERS = ("hf", "hf-merged")
PRIVATE_README = f"""{PRIVATE_NOTE}

The files in this folder hold exact statistics of the private training data:
per-batch losses, overflow counts, clipped fractions, gradient norms, batch
sizes, train accuracy and loss, per-step times. None of them is noised or accounted
in the run's epsilon. Use them to debug the run; do not publish them.

Safe to publish (privatized, held-out test, or the public plan):
{", ".join(RUN_FILES)}, tensorboard/ when training.writers writes it, and
{EXPORTED_PARAMS}, {" and ".join(f"{d}/" for d in EXPORTED_FOLDERS)} once `dpmp export`
writes them.
Secret: ../checkpoints/ (the noise keys, the sampler's seed and a fingerprint
of the data: as secret as the data itself).

This folder and checkpoints/ are readable by their owner only (folders 0700,
files 0600); keep them so.
"""

NONPRIVATE_LOSS_SCALE = (
    "loss_scale.kind = 'nonprivate_dynamic': the loss scale was adjusted from the EXACT "
    "overflow count, a function of the private data that is neither noised nor accounted. "
    "This run is NOT differentially private; its epsilon covers the noised gradients only."
)
REPRODUCIBLE_NOISE = (
    "privacy.reproducible_noise = true: the gradient noise, the overflow-count noise, the "
    "Poisson sampling and the standardisation noise were derived from training.seed, which "
    "is in this report. Anyone who knows it and the other records can rerun the training "
    "and tell which dataset it was. This run is NOT differentially private."
)
NONPRIVATE_STANDARDIZE = (
    "data.standardize = 'nonprivate': every feature was scaled by the EXACT mean and std of "
    "the training data, neither noised nor accounted, so every example's gradient depends "
    "on every record. This run is NOT differentially private."
)


USER_LEVEL = (
    "privacy.unit = 'user': the guarantee protects all of one user's training records "
    "together (zero-out neighbours of a user: all of its records replaced by null records); "
    "users are Poisson-sampled, each sampled user gives at most privacy.user_records "
    "records, and the clip bounds the norm of the sum of their gradients. The numbers of "
    "users and of records are public."
)
USER_LEVEL_RECORDS = (
    "privacy.unit = 'user' with privacy.user_sampling = 'records': the guarantee protects "
    "all of one user's training records together (zero-out neighbours of a user); each "
    "user keeps at most privacy.user_records records, chosen at random, every kept record "
    "is Poisson-sampled and clipped on its own, and the accountant composes one user's up "
    "to user_records sampled records (the binomial mixture of Gaussians). The numbers of "
    "users and of records are public."
)


def user_relation(config) -> str:
    """The neighbouring relation of the run, in words (report)."""
    if config.privacy.unit != "user":
        return accounting.NEIGHBOURING_RELATION_NOTE
    return USER_LEVEL if config.privacy.user_sampling == "users" else USER_LEVEL_RECORDS


def unit_text(config, data) -> str:
    """What the run's neighbours differ in, and what is public, for the log."""
    if config.privacy.unit != "user":
        return "(the number of records is public)"
    return (
        f"of a user: all of one user's records null (the {data.num_users:,} users and "
        f"{data.num_train:,} records are public; at most {config.privacy.user_records} "
        + (
            "records of a user per step)"
            if config.privacy.user_sampling == "users"
            else "records of a user kept, each sampled on its own)"
        )
    )


def privacy_warnings(config, num_train: int | None = None) -> list[str]:
    """Why a run of ``config`` on ``num_train`` records (users, with ``privacy.unit =
    "user"``) is NOT differentially private (empty: it is)."""
    out = []
    what = "users" if config.privacy.unit == "user" else "training records"
    if num_train and config.privacy.delta >= 1 / num_train:
        out.append(
            f"privacy.delta = {config.privacy.delta:g} is not below 1/n = {1 / num_train:.3g} "
            f"(n = {num_train:,} {what}; privacy.allow_large_delta = true): a "
            "mechanism that publishes a record in the clear meets such a guarantee. This run "
            "is NOT differentially private."
        )
    if config.privacy.reproducible_noise:
        out.append(REPRODUCIBLE_NOISE)
    if config.loss_scale.kind == "nonprivate_dynamic":
        out.append(NONPRIVATE_LOSS_SCALE)
    if config.data.standardize == "nonprivate":
        out.append(NONPRIVATE_STANDARDIZE)
    if config.privacy.sampling == "shuffle":
        out.append(ShuffledSampler.privacy_note)
    drawn = drawn_sampler(config.privacy.noise_sampler, config.precision)
    if drawn.privacy_warning:
        out.append(drawn.privacy_warning)
    return out


def audit_warnings(audit: dict[str, Any]) -> list[str]:
    """A precision audit that failed, or that could not check the step (it crashed,
    or did not recognise the noise: ``ok`` is None): either way the sensitivity and
    the noise the accounting assumes are not certified, and the run is not
    reported private (it fails closed)."""
    ok = audit.get("ok")
    if ok is True:
        return []
    if ok is None:
        return [
            "the precision audit of the private step could not check it "
            f"({_unchecked(audit)}): the clipped sum's sensitivity and the noise the "
            "accounting assumes were not certified, so this run is not reported "
            "differentially private"
        ]
    kinds = sorted({v.get("kind", "?") for v in audit.get("violations", [])})
    missing = audit.get("missing") or []
    found = []
    if kinds:
        found.append("violations: " + ", ".join(kinds))
    if missing:
        found.append("missing: " + ", ".join(missing))
    return [
        f"the precision audit of the private step failed ({', '.join(found)}): the "
        "clipped sum's sensitivity or the noise the accounting assumes is not certified, "
        "so epsilon may not hold"
    ]


def _unchecked(audit: dict[str, Any]) -> str:
    """Why an audit with ``ok`` None did not check the step."""
    return audit.get("error") or "it did not recognise the step's noise"


def run_failures(report: dict[str, Any]) -> list[str]:
    """Why a finished run did not do what was asked (empty: it did), from the
    report's released numbers alone: an early stop by the budget, a failed or
    unchecked audit, parameters that are not finite, or (private dynamic loss
    scale) a noised overflow count of at least half the expected examples.

    An exit status, a warning or a line in a scheduler's log is a release too:
    nothing here reads an exact statistic. The exact overflow count, and what it
    says of the run (``overflow_diagnosis``), stay in ``private/diagnostics.json``."""
    out = []
    stopped = report.get("stopped_early")
    if stopped:
        out.append(f"the privacy budget stopped it early: {stopped['reason']}")
    audit = report.get("audit") or {}
    if audit.get("ok") is False:
        out.append("the precision audit of the step found violations (report.json: audit)")
    elif audit.get("ok") is None:
        out.append(f"the precision audit of the step could not check it: {_unchecked(audit)}")
    if report.get("finite_params") is False:
        out.append("the trained parameters are not finite")
    noised = (report.get("overflow") or {}).get("noised_count_total")
    expected = report.get("steps", 0) * report["config"]["training"]["expected_batch_size"]
    if noised is not None and expected and noised >= expected / 2:
        out.append(
            f"about {min(noised / expected, 1):.0%} of the examples overflowed (noised count "
            f"{noised:.0f} of about {expected} examples): the model barely trained; lower "
            "loss_scale.initial or loss_scale.max_scale, or use bf16"
        )
    return out


def overflow_diagnosis(nonfinite: int, seen: int) -> list[str]:
    """What the exact (private) overflow count says of a run, for
    ``private/diagnostics.json`` only: never printed, logged or turned into an
    exit status (it is not a released number)."""
    if not seen or nonfinite < seen / 2:
        return []
    return [
        "most of the examples overflowed: the model barely trained; lower "
        "loss_scale.initial, use loss_scale.kind = 'private_dynamic' (its noised counts "
        "are released and accounted), or use bf16"
    ]


def privacy_notes(config, breakdown: accounting.EpsilonBreakdown) -> list[str]:
    """What the published files hold, and the releases besides the gradients."""
    notes = [
        "report.json, metrics.jsonl, train.log and the plots hold only privatized numbers, "
        "numbers computed on the held-out test split, and the public plan. private/ holds "
        f"exact training statistics ({PRIVATE_NOTE}). checkpoints/ hold the secret noise "
        "keys, the sampler's seed and a fingerprint of the data: keep them as secret as "
        "the data.",
    ]
    if breakdown.noise_residual:
        notes.append(
            "the gradient noise is dpmp's snapped Gaussian (float64 inverse-CDF normal, "
            "rounded to a power-of-two grid); its accounted floating-point residual "
            f"({breakdown.noise_residual:.3g}) is included in the run's epsilon."
        )
    d = config.data
    if d.standardize == "private":
        notes.append(
            "features were standardised by a mean and std released with the Gaussian "
            f"mechanism (features clipped to L2 norm {d.standardize_clip:g}, noise multiplier "
            f"{d.standardize_noise_multiplier:g} on each sum); its epsilon cost "
            f"({breakdown.preprocessing:.4g}) is included in the run's epsilon."
        )
    return notes


# ---- per-step records --------------------------------------------------------------


def public_record(
    *,
    step: int,
    epsilon: float,
    delta: float,
    loss_scale: float,
    next_loss_scale: float,
    loss_scale_changes: int,
    noised_overflow: float | None,
    noised_overflow_total: float | None,
    evaluation: dict[str, Any] | None,
) -> dict[str, Any]:
    """A ``metrics.jsonl`` record: public numbers only.

    ``noised_overflow`` is the privatized count a private dynamic loss scale
    released (None for other scales); ``evaluation`` is this step's
    evaluation, of which only the test metrics are taken.
    """
    record = {
        "step": step,
        "epsilon": epsilon,
        "delta": delta,
        "loss_scale": loss_scale,
        "next_loss_scale": next_loss_scale,
        "loss_scale_changes": loss_scale_changes,
    }
    if noised_overflow is not None:
        record["noised_overflow"] = noised_overflow
        record["noised_overflow_total"] = noised_overflow_total
    if evaluation:
        record["test_accuracy"] = evaluation["test_accuracy"]
        record["test_loss"] = evaluation["test_loss"]
    return record


def private_record(
    *, step: int, stats, totals: dict[str, Any], step_time_s: float, evaluation
) -> dict[str, Any]:
    """A ``private/metrics.jsonl`` record: exact statistics of the batch (NOT private)."""
    n = int(stats.num_examples)
    record = {
        "step": step,
        "loss": float(stats.loss_mean),
        "overflow": int(stats.num_nonfinite),
        "overflow_total": totals["overflow"],
        "clipped_fraction": int(stats.num_clipped) / max(n, 1),
        "batch_size": n,
        "grad_norm_mean": float(stats.norm_mean),
        "grad_norm_max": float(stats.norm_max),
        "step_time_s": step_time_s,
        "elapsed_s": totals["elapsed_s"],
    }
    if evaluation:
        record["train_accuracy"] = evaluation["train_accuracy"]
        record["train_loss"] = evaluation["train_loss"]
    return record


def public_info(record: dict[str, Any]) -> dict[str, Any]:
    """What the progress bar and the ``train`` callback get: the public record, less
    its step (the callback's first argument)."""
    return {k: v for k, v in record.items() if k != "step"}


def progress_fields(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields, from a public record."""
    fields = {"eps": epsilon_text(record["epsilon"]), "scale": f"{record['next_loss_scale']:g}"}
    if "noised_overflow_total" in record:
        fields["noised overflow"] = f"{record['noised_overflow_total']:.0f}"
    if record.get("test_accuracy") is not None:  # None: no labelled held-out prediction
        fields["test acc"] = f"{record['test_accuracy']:.3f}"
    return fields


def held_out_text(evaluation: dict[str, Any]) -> str:
    """The held-out evaluation as ``train.log``'s last line states it: its accuracy,
    or why the run reports no test accuracy, loss or perplexity."""
    if evaluation.get("test_accuracy") is None:
        return (
            "no test accuracy, loss or perplexity (the held-out split holds no labelled "
            "prediction: no records, or every label -1)"
        )
    return f"test accuracy {evaluation['test_accuracy']:.4f}"


# ---- end of run --------------------------------------------------------------------


def private_diagnostics(
    *,
    totals: dict[str, Any],
    sampler,
    evaluation: dict[str, Any],
    wall_time_s: float,
    data: Any = None,
) -> dict[str, Any]:
    """``private/diagnostics.json``: the run's exact totals (NOT private; the run
    directory labels the file with ``PRIVATE_NOTE``), and how many of ``data``'s
    records were cut (text)."""
    out = {
        "overflow": {
            "examples_nonfinite": totals["overflow"],
            "steps_with_overflow": totals["steps_with_overflow"],
        },
        "clipping": {
            "clipped_fraction": totals["clipped"] / max(totals["examples"], 1),
            "examples_seen": totals["examples"],
        },
        "overflow_diagnosis": overflow_diagnosis(totals["overflow"], totals["examples"]),
        "train_accuracy": evaluation.get("train_accuracy"),
        "train_loss": evaluation.get("train_loss"),
        "wall_time_s": wall_time_s,
        "train_loop_s": totals["elapsed_s"],
    }
    if getattr(sampler, "poisson", False):
        out["sampling"] = {
            "truncated_steps": sampler.num_truncated,
            "dropped_examples": sampler.num_dropped,
        }
    if getattr(data, "cut_to", None) is not None:
        train, test = data.records_cut
        out["records_cut"] = {"cut_to": data.cut_to, "train": train, "test": test}
    return out


def epsilon_text(epsilon: float) -> str:
    """The run's epsilon as every public line prints it: five decimals, rounded up
    (never below the guarantee), the same in the summary, ``train.log``, the
    progress bar and the plots."""
    return f"{math.ceil(epsilon * 1e5 - 1e-6) / 1e5:.5f}"


def _sampling_section(config, step, sampler, completed: int, breakdown) -> dict[str, Any]:
    """How batches were drawn, and what truncating a Poisson sample may cost."""
    poisson = config.privacy.sampling == "poisson"
    sampling: dict[str, Any] = {
        "kind": "poisson" if poisson else "shuffle",
        "sampling_prob": step.plan.sampling_prob,
        "expected_batch_size": config.training.expected_batch_size,
        "padded_batch_size": sampler.padded_batch_size,
        "privacy_note": sampler.privacy_note,
    }
    if poisson:
        sampling["truncation_probability"] = sampler.truncation_probability
        sampling["truncation_delta"] = sampler.truncation_delta(completed, breakdown.total)
    return sampling


def _overflow_section(config, step, tracker, totals: dict[str, Any], breakdown) -> dict[str, Any]:
    """The loss scale's releases (noised overflow counts) and their epsilon."""
    kind = config.loss_scale.kind
    overflow: dict[str, Any] = {
        "privatized": kind == "private_dynamic",
        "count_releases": tracker.count_releases,
        "count_noise_stddev": step.plan.count_noise_stddev,
        "epsilon_cost": breakdown.counts,
        "epsilon_without_counts": breakdown.dpsgd,
    }
    if kind == "private_dynamic":
        overflow["noised_count_total"] = totals["noised_overflow"]
        # every step's released count, in step order (the last ones if a run resumed
        # from a checkpoint that did not keep them)
        overflow["noised_counts"] = list(totals.get("noised_counts", []))
        overflow["privacy"] = "only noised counts are released (exact counts stay in private/)"
    elif kind == "nonprivate_dynamic":
        overflow["privacy"] = "NOT PRIVATE: decisions used the exact count, unaccounted"
    else:
        overflow["privacy"] = f"loss scale '{kind}' releases nothing; it costs no epsilon"
    return overflow


def _standardize_section(config, step, breakdown) -> dict[str, Any]:
    """The preprocessing release (private standardisation) and its epsilon."""
    d = config.data
    standardize: dict[str, Any] = {"mode": d.standardize}
    if d.standardize == "private":
        standardize.update(
            clip=d.standardize_clip,
            noise_multiplier=d.standardize_noise_multiplier,
            release_noise_multiplier=step.plan.budget.preprocessing_noise_multiplier,
            epsilon_cost=breakdown.preprocessing,
        )
    elif d.standardize == "nonprivate":
        standardize["privacy"] = "NOT PRIVATE: exact training mean and std, unaccounted"
    return standardize


def _mechanism_section(config, step, breakdown) -> dict[str, Any]:
    """The noise mechanism, its strategy and its expected error: the root mean
    squared error of the prefix sums of the steps' noise, in units of the sum's L2
    sensitivity, beside DP-SGD's at the same epsilon (its sigma calibrated for the
    same steps, Poisson-sampled from all n at the same expected batch, exact
    Gaussian; jax-privacy's error: ``BandedMF.prefix_rmse``). Public: functions of
    the plan."""
    strategy, steps = step.fn.strategy, config.training.steps
    if strategy is None:
        return {"name": config.privacy.mechanism}
    sigma = step.plan.noise_multiplier * strategy.sensitivity_factor(step.sampler.padded_batch_size)
    try:
        dpsgd = accounting.calibrate_noise_multiplier(
            target_epsilon=breakdown.total,
            sampling_prob=config.training.expected_batch_size / step.sampler.num_examples,
            steps=steps,
            delta=step.plan.budget.delta,
            accountant=config.privacy.accountant,
            noised_coordinates=None,
        ) * math.sqrt((steps + 1) / 2)
    except ValueError:
        dpsgd = None
    described = strategy.describe()
    return described | {
        "name": config.privacy.mechanism,
        "sensitivity_factor": strategy.sensitivity_factor(step.sampler.padded_batch_size),
        "prefix_rmse": sigma * described["prefix_rmse_per_stddev"],
        "dpsgd_prefix_rmse_same_epsilon": dpsgd,
        "groups": getattr(step.sampler, "groups", None),
    }


def _noise_section(config, step, breakdown) -> dict[str, Any]:
    """The gradient noise: its sampler, the residual accounted, its stddev."""
    sensitivity = step.fn.sensitivity
    factor = (
        1.0
        if step.fn.strategy is None
        else step.fn.strategy.sensitivity_factor(step.sampler.padded_batch_size)
    )
    return {
        "sampler": config.privacy.noise_sampler,
        "noised_coordinates": step.plan.budget.noised_coordinates,
        "epsilon_residual": breakdown.noise_residual,
        # The sum's L2 sensitivity as computed (the clip norm plus a bound on the
        # floating-point rounding of the clipped sum, from public constants: the
        # padded batch size, the partial sums, the dtypes and the model's shapes);
        # the noise stddev is noise_multiplier times it.
        "l2_sensitivity": sensitivity.get("sensitivity"),
        "stddev": step.plan.noise_multiplier * sensitivity.get("sensitivity", math.nan) * factor,
        "sensitivity_bound": dict(sensitivity),
        "mechanism": _mechanism_section(config, step, breakdown),
    }


def _privacy_section(config, step, breakdown, warnings_: list[str]) -> dict[str, Any]:
    """The guarantee: epsilon, delta and its parts, the relation, the noise."""
    p = config.privacy
    return {
        "policy": config.policy,
        "private": not warnings_,
        "privacy_warnings": warnings_,
        "privacy_notes": privacy_notes(config, breakdown),
        "privacy_unit": p.unit,
        "num_users": step.data.num_users if p.unit == "user" else None,
        "user_records": p.user_records if p.unit == "user" else None,
        "user_sampling": p.user_sampling if p.unit == "user" else None,
        "neighbouring_relation": user_relation(config),
        "accounting_relation": "add_or_remove",
        # the guarantee: the tracker's epsilon, the one calibrated to, stopped at and
        # shown in every metrics.jsonl record; its parts are breakdown's
        "epsilon": breakdown.total,
        "target_epsilon": p.target_epsilon,
        "delta": p.delta,
        "delta_parts": {
            "accountant": step.plan.budget.delta,
            "truncation_reserved": step.plan.truncation_delta,
            "note": "delta is the whole: the accountant's epsilon holds at the delta a "
            "possibly truncated Poisson sample leaves (its part reserved), and covers the "
            "snapped noise's residual, whose failure probability is part of it",
        },
        "accountant": p.accountant,
        "noise_multiplier": step.plan.noise_multiplier,
        "noise_multiplier_calibrated": step.plan.calibrated,
        "noise": _noise_section(config, step, breakdown),
        "l2_clip_norm": p.l2_clip_norm,
    }


def _test_metrics(step, evaluation: dict[str, Any]) -> dict[str, Any]:
    """Held-out accuracy, loss and (next-token data) perplexity."""
    return {
        "test_accuracy": evaluation.get("test_accuracy"),
        "test_loss": evaluation.get("test_loss"),
        # next-token data: accuracy and loss are per predicted token (held out)
        "test_perplexity": (
            math.exp(evaluation["test_loss"])
            if step.data.task == "next_token" and evaluation.get("test_loss") is not None
            else None
        ),
    }


def build_report(
    *,
    config,
    step,
    tracker: accounting.BudgetTracker,
    completed: int,
    totals: dict[str, Any],
    scale_history: list,
    evaluation: dict[str, Any],
    audit: dict[str, Any],
    stopped: dict[str, Any] | None,
    sampler,
    params,
    final_scale: float,
    versions: dict[str, Any],
    finite_params: bool,
    num_params: int,
    starting_point: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``report.json`` of a run of ``config`` with ``step`` (a ``PrivateStep``): the
    plan, epsilon, test metrics, loss scale, audit. Public."""
    breakdown = tracker.breakdown()
    warnings_ = privacy_warnings(config, step.sampler.num_examples) + audit_warnings(audit)
    return {
        **_privacy_section(config, step, breakdown, warnings_),
        "steps": completed,
        "planned_steps": config.training.steps,
        "stopped_early": stopped,
        **_test_metrics(step, evaluation),
        "overflow": _overflow_section(config, step, tracker, totals, breakdown),
        "loss_scale": {
            "kind": config.loss_scale.kind,
            "initial": scale_history[0][1],
            "final": final_scale,
            "changes": totals["loss_scale_changes"],
            "history": scale_history,
            "history_note": "[step, value]: the scale used from that (1-based) step on",
        },
        "standardize": _standardize_section(config, step, breakdown),
        "clipping": {
            "method_requested": step.clipping["requested"],
            "method": step.clipping["method"],
            "method_reason": step.clipping["reason"],
            "unit": step.clipping.get("unit", "example"),
            "layers": step.clipping["layers"],
        },
        "audit": audit,
        "sampling": _sampling_section(config, step, sampler, completed, breakdown),
        "mesh": mesh_summary(step.fn.mesh, sharded=config.training.shard_params),
        "model": step.model.summary(params),
        "data": step.data.summary(),
        "config": public_config(config),
        "versions": versions,
        "num_params": num_params,
        "finite_params": finite_params,
        # pre-trained on public text, given, or (LoRA) the model's initialisation
        "starting_point": starting_point,
    }


def mesh_summary(mesh, *, sharded: bool = False) -> dict[str, Any]:
    """Where the run ran (the public plan's hardware, no data)."""
    import jax

    devices = [jax.local_devices()[0]] if mesh is None else mesh.devices
    reduce = "psum_scatter (parameters sharded)" if sharded else "psum"
    return {
        "devices": len(devices),
        "processes": len({d.process_index for d in devices}),
        "platform": devices[0].platform,
        "sharded_params": sharded,
        "all_reduce": None if mesh is None else f"{reduce} of the clipped sums, accumulate dtype",
    }


def config_dict(config) -> dict[str, Any]:
    """The config as plain JSON values (what report.json and checkpoints hold)."""
    import json

    return json.loads(json.dumps(config.to_dict()))


def public_config(config) -> dict[str, Any]:
    """``config_dict`` as ``report.json`` publishes it: a data, pre-training,
    tokenizer or checkpoint path by its file or folder name only (a full path
    would publish the operator's folders)."""
    out = config_dict(config)
    for section, key in PATH_KEYS:
        path = out.get(section, {}).get(key)
        if path:
            out[section][key] = Path(path).name
    return out


# The config keys that hold the operator's paths (published by name only).
PATH_KEYS = (("data", "path"), ("data", "tokenizer"), ("pretrain", "path"), ("model", "checkpoint"))


# ---- what `dpmp report` says about the files ---------------------------------------


def file_inventory(run_dir: str | Path) -> dict[str, list[str]]:
    """The run directory's files, by whether they may be published.

    Returns ``{"public": [...], "private": [...], "secret": [...]}``: paths
    relative to ``run_dir`` that exist (``private`` and ``secret`` folders as
    ``name/``).
    """
    run_dir = Path(run_dir)
    public = [name for name in PUBLIC_FILES if (run_dir / name).is_file()]
    if (run_dir / "pretrained").is_dir():  # trained on public text only
        public.append("pretrained/")
    if (run_dir / "tensorboard").is_dir():  # training.writers: the public records' scalars
        public.append("tensorboard/")
    public += [f"{d}/" for d in EXPORTED_FOLDERS if (run_dir / d / "privacy.json").is_file()]
    private = [f"{PRIVATE_DIR}/"] if (run_dir / PRIVATE_DIR).is_dir() else []
    secret = ["checkpoints/"] if (run_dir / "checkpoints").is_dir() else []
    return {"public": public, "private": private, "secret": secret}


def report_private(run_dir: str | Path) -> bool | None:
    """``report.json``'s ``private`` (None: no readable report)."""
    try:
        report = json.loads((Path(run_dir) / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report.get("private") if isinstance(report, dict) else None


def inventory_lines(run_dir: str | Path) -> list[str]:
    """``file_inventory`` in words, for the command line."""
    inv = file_inventory(run_dir)
    public = ", ".join(inv["public"]) or "-"
    if report_private(run_dir) is False:
        lines = [
            "public files (this run is NOT differentially private, see privacy_warnings: "
            f"publishing them is not private): {public}"
        ]
    else:
        lines = ["safe to publish: " + public]
    if inv["private"]:
        lines.append(f"private ({PRIVATE_NOTE}; owner-only, 0700): " + ", ".join(inv["private"]))
    if inv["secret"]:
        lines.append(
            "secret (noise keys, sampler seed, data fingerprint; as secret as the data; "
            "owner-only, 0700): " + ", ".join(inv["secret"])
        )
    return lines
