"""A finished run of a checkpoint's model as a Hugging Face or PEFT folder, its
guarantee attached.

``export_hf(run_dir, merge=...)`` reads what the run released (its trained
parameters: ``params.npz`` if exported, else the newest checkpoint's; its
``report.json``) over the public checkpoint folder it started from
(``model.checkpoint``, or the folder given instead) and writes one folder:

* with ``merge``: the checkpoint's ``config.json`` and its weight files again
  (the same tensor names, dtypes and shards) holding the trained weights, LoRA
  adapters merged in (``W + lora_alpha / r * A B``, in float32, then rounded
  to the stored dtype): ``transformers.AutoModelForCausalLM.from_pretrained``
  loads it;
* without: a PEFT LoRA adapter, ``adapter_config.json`` (``lora_alpha / r``
  is dpmp's scale; ``base_model_name_or_path`` the checkpoint folder's name,
  or ``base_model``) and ``adapter_model.safetensors``:
  ``peft.PeftModel.from_pretrained(base, folder)`` loads it over the original
  checkpoint. A full fine-tune (``model.lora_rank = 0``) has no adapters: it
  is exported merged only;
* both: the checkpoint's tokenizer and generation files, where present
  (``TOKENIZER_FILES``), a model card ``README.md`` and ``privacy.json``.

``privacy.json`` (``privacy_record``) is the guarantee in numbers that
``report.json`` released (and, for the run ``dpmp tune`` chose, ``tune.json``:
then epsilon and delta are the whole search's): the privacy unit, epsilon,
delta, the accountant, the noise sampler and its accounted residual, steps,
clip norm, noise multiplier, sampling, the precision audit's verdict. Nothing
secret leaves: no key, seed, data fingerprint, exact statistic (``private/``)
or path of the operator's folders. A run whose report says it is not private
is refused unless ``allow_not_private`` (then ``privacy.json`` says
``"private": false`` and why).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dpmp.app.checkpoint import CheckpointError
from dpmp.app.config import Config, ConfigError
from dpmp.app.run_dir import REPORT_FILE

__all__ = ["PRIVACY_FILE", "TOKENIZER_FILES", "export_hf", "privacy_record"]

PRIVACY_FILE, CARD_FILE = "privacy.json", "README.md"
# the public checkpoint's files a Hugging Face folder carries beside its weights
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
PRIVACY_UNIT = (
    "one record of the training data (one line of a text file, one JSONL record, one "
    "example): the guarantee bounds what the model reveals about any one of them"
)
_FORMAT = "dpmp privacy.json 1"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def _released(run_dir: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
    """``(run, report, search)``: the run folder, its ``report.json``, and the
    ``tune.json`` of the search that chose it (None: not tuned). ``run_dir`` may be
    the run, or a search's folder (its chosen run is ``best/``)."""
    from dpmp.app.tune import BEST_DIR, TUNE_FILE

    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory: no such folder {str(run_dir)!r}")
    search = None
    if (run / TUNE_FILE).is_file():
        search, run = _read_json(run / TUNE_FILE), run / BEST_DIR
        if not (search.get("chosen") or {}).get("run_dir"):
            raise CheckpointError(f"{run_dir}: the search chose no run (tune.json)")
    elif (run.parent / TUNE_FILE).is_file():
        above = _read_json(run.parent / TUNE_FILE)
        if (above.get("chosen") or {}).get("run_dir") == run.name:
            search = above
    report_path = run / REPORT_FILE
    if not report_path.is_file():
        raise CheckpointError(f"{report_path} not found (the run has not finished)")
    report = _read_json(report_path)
    if not isinstance(report, dict) or "config" not in report or "epsilon" not in report:
        raise CheckpointError(f"{report_path}: not a dpmp report")
    return run, report, search


def _audit(report: dict[str, Any]) -> dict[str, Any] | None:
    audit = report.get("audit")
    if not isinstance(audit, dict) or not audit:
        return None
    return {
        "ok": audit.get("ok"),
        "violations": len(audit.get("violations") or []),
        "missing": list(audit.get("missing") or []),
        "checked": dict(audit.get("counts") or {}),
    }


def privacy_record(report: dict[str, Any], search: dict[str, Any] | None = None) -> dict:
    """``privacy.json``: the guarantee of the run ``report`` describes (its
    ``report.json``), or of the search ``search`` (its ``tune.json``) that chose
    it. Every number is one of theirs: released or public plan."""
    noise = report.get("noise") or {}
    sampling = report.get("sampling") or {}
    warnings = list(report.get("privacy_warnings") or [])
    private = report.get("private") is True
    guarantee = "this run's (report.json)"
    epsilon, delta = report["epsilon"], report["delta"]
    tuned = None
    if search is not None:
        warnings += [w for w in search.get("privacy_warnings") or [] if w not in warnings]
        private = private and search.get("private") is True
        guarantee = "the whole hyperparameter search (dpmp tune, tune.json) that chose this run"
        epsilon, delta = search["epsilon"], search["delta"]
        tuned = {
            "epsilon": search["epsilon"],
            "delta": search["delta"],
            "run_epsilon": report["epsilon"],
            "method": (search.get("accounting") or {}).get("method"),
            "note": search.get("guarantee"),
        }
    return {
        "format": _FORMAT,
        "private": private,
        "privacy_warnings": warnings,
        "privacy_unit": (  # report.json names the unit ("record" or "user"); say what it is
            PRIVACY_UNIT
            if report.get("privacy_unit", "record") == "record"
            else report.get("neighbouring_relation")
        ),
        "neighbouring_relation": report.get("neighbouring_relation"),
        "guarantee": guarantee,
        "epsilon": epsilon,
        "delta": delta,
        "accountant": report.get("accountant"),
        "noise_sampler": noise.get("sampler"),
        "noise_residual_epsilon": noise.get("epsilon_residual"),
        "steps": report.get("steps"),
        "l2_clip_norm": report.get("l2_clip_norm"),
        "l2_sensitivity": noise.get("l2_sensitivity"),
        "noise_multiplier": report.get("noise_multiplier"),
        "sampling": {
            "kind": sampling.get("kind"),
            "sampling_prob": sampling.get("sampling_prob"),
            "expected_batch_size": sampling.get("expected_batch_size"),
        },
        "policy": report.get("policy"),
        "tuning_search": tuned,
        "precision_audit": _audit(report),
        "dpmp_version": (report.get("versions") or {}).get("dpmp"),
    }


def _card(privacy: dict[str, Any], *, merged: bool, base: str, kind: str) -> str:
    """The model card ``README.md``: Hugging Face's front matter and the guarantee in words."""
    library = "transformers" if merged else "peft"
    what = "merged fine-tuned weights" if merged else "a LoRA adapter (PEFT)"
    verdict = "differentially private" if privacy["private"] else "NOT differentially private"
    audit = privacy["precision_audit"]
    lines = [
        "---",
        f"library_name: {library}",
        f"base_model: {base}",
        "tags:",
        "- dpmp",
        "- differential-privacy",
        f"- {kind}",
        "---",
        "",
        f"# {base}, fine-tuned with differential privacy (dpmp)",
        "",
        f"This folder holds {what} over `{base}`, trained by dpmp: {verdict}.",
        "",
        f"- Guarantee: ({privacy['epsilon']:.6g}, {privacy['delta']:.3g})-differential "
        f"privacy, {privacy['guarantee']}.",
        f"- Privacy unit: {privacy['privacy_unit']}.",
        f"- Accountant: {privacy['accountant']}; noise sampler: {privacy['noise_sampler']} "
        f"(its residual, accounted: epsilon {privacy['noise_residual_epsilon']:.3g}).",
        f"- DP-SGD: {privacy['steps']} steps, clip norm {privacy['l2_clip_norm']:g}, noise "
        f"multiplier {privacy['noise_multiplier']:.6g}, {privacy['sampling']['kind']} sampling "
        f"(probability {privacy['sampling']['sampling_prob']:.6g}).",
        "- Precision audit of the private step: "
        + ("not run" if audit is None else "passed" if audit["ok"] else "did not pass")
        + ".",
    ]
    lines += [f"- Warning: {w}" for w in privacy["privacy_warnings"]]
    lines += ["", "`privacy.json` holds these numbers, as the run's report released them.", ""]
    return "\n".join(lines)


def _base_folder(config, checkpoint: str | Path | None) -> Path:
    """The public checkpoint folder the run started from (``model.checkpoint``, or
    ``checkpoint`` if it has moved)."""
    from dpmp.app.published import checkpoint_folder

    m = config.model
    if checkpoint is None and not Path(m.checkpoint).is_dir():
        raise ConfigError(
            f"model.checkpoint: report.json names the checkpoint folder {m.checkpoint!r} "
            "without its path (it publishes none of your folders): give the folder with "
            "--checkpoint DIR"
        )
    field = "model.checkpoint" if checkpoint is None else "checkpoint"
    return checkpoint_folder(m.checkpoint if checkpoint is None else checkpoint, field)


def _trained(run: Path, config: Config, started: str | None, folder: Path):
    """``(loaded, trained)``: the checkpoint as the run's family loads it (its
    parameters in the stored dtypes) and the run's trained parameters (the
    adapters, with ``model.lora_rank``)."""
    import jax

    from dpmp.app.checkpoint import load_params
    from dpmp.app.generate import _params_source
    from dpmp.app.published import load_checkpoint
    from dpmp.app.trainer.pretrain import params_digest
    from dpmp.models import init_adapters

    m = config.model
    loaded = load_checkpoint(m.kind, folder, config.precision)
    if started is not None and params_digest(loaded.params) != started:
        raise CheckpointError(
            f"checkpoint: {str(folder)!r} holds other weights than the run started from "
            "(report.json: starting_point.params_sha256)"
        )
    key = jax.random.key(0)
    if m.lora_rank:
        like = jax.eval_shape(
            lambda k: init_adapters(loaded.params, m.lora_rank, k, m.lora_targets), key
        )
    else:
        like = jax.eval_shape(loaded.model.init, key)  # the trainer's float32 masters
    return loaded, load_params(_params_source(run), like)


def _fresh_folder(out: Path, force: bool) -> Path:
    """A new empty folder beside ``out`` to write into (renamed to ``out`` at the
    end); ``out`` must not exist, or, with ``force``, be an earlier export."""
    if out.exists():
        if not force:
            raise ConfigError(f"out: {str(out)!r} exists; choose another folder, or --force")
        if not (out / PRIVACY_FILE).is_file():
            raise ConfigError(
                f"out: {str(out)!r} exists and is not an export (no {PRIVACY_FILE}): "
                "--force replaces an earlier export only"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def export_hf(
    run_dir: str | Path,
    *,
    merge: bool = False,
    out: str | Path | None = None,
    checkpoint: str | Path | None = None,
    base_model: str | None = None,
    force: bool = False,
    allow_not_private: bool = False,
) -> Path:
    """Writes the finished run in ``run_dir`` as a Hugging Face folder (``merge``)
    or a PEFT adapter, with ``privacy.json`` and a model card (see the module
    docstring); returns the folder.

    Args:
      run_dir: the run, or a ``dpmp tune`` search's folder (its chosen run).
      merge: merged weights in the checkpoint's layout; else a PEFT adapter.
      out: the folder to write (default ``RUN/hf-merged`` or ``RUN/hf``).
      checkpoint: the run's checkpoint folder, if not where ``model.checkpoint`` says.
      base_model: the base's name in ``adapter_config.json`` and the model card
        (e.g. its Hugging Face Hub id; default the checkpoint folder's name).
      force: replace ``out`` if it is an earlier export.
      allow_not_private: export a run whose report says it is not private.

    Raises:
      CheckpointError: no finished run, no parameters, or a checkpoint folder
        of other weights than the run started from.
      ConfigError: not a run of a checkpoint's model, a run that is not private
        (without ``allow_not_private``), an adapter export of a full fine-tune,
        or ``out`` exists.
      DataError: a bad checkpoint folder (named).
    """
    from dpmp.app.config_checkpoint import CHECKPOINT_KINDS

    run, report, search = _released(run_dir)
    privacy = privacy_record(report, search)
    config = Config.from_dict(report["config"])
    m = config.model
    if m.kind not in CHECKPOINT_KINDS:
        raise ConfigError(
            f"model.kind: the run trained {m.kind!r}; a Hugging Face export needs a run of "
            f"model.kind = {', '.join(map(repr, CHECKPOINT_KINDS))}"
        )
    if not privacy["private"] and not allow_not_private:
        raise ConfigError(
            f"{run / REPORT_FILE}: this run is NOT differentially private (privacy_warnings); "
            "export it anyway with --allow-not-private (privacy.json then says so)"
        )
    if not merge and not m.lora_rank:
        raise ConfigError(
            "model.lora_rank = 0: a full fine-tune has no LoRA adapters to export as a PEFT "
            "adapter; export its merged weights with --merge"
        )
    out = Path(out) if out is not None else run / ("hf-merged" if merge else "hf")
    folder = _base_folder(config, checkpoint)
    started = (report.get("starting_point") or {}).get("params_sha256")
    loaded, trained = _trained(run, config, started, folder)
    tmp = _fresh_folder(out, force)
    try:
        _write(tmp, folder, loaded, trained, m, privacy, merge, base_model or folder.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(tmp: Path, folder: Path, loaded, trained, m, privacy, merge: bool, base: str) -> None:
    """The export's files in ``tmp``."""
    from safetensors.numpy import save_file

    from dpmp.models import merge as merge_adapters
    from dpmp.models._hf_export import PEFT_CONFIG, PEFT_WEIGHTS, layout, peft_adapter, write_merged

    hf = layout(loaded.config)
    if merge:
        params = trained
        if m.lora_rank:  # in float32; write_merged rounds each to its stored dtype
            params = merge_adapters(
                loaded.params, trained, m.lora_alpha, wide=True, targets=m.lora_targets
            )
        write_merged(folder, tmp, params, hf)
        shutil.copyfile(folder / "config.json", tmp / "config.json")
    else:
        fields, tensors = peft_adapter(trained, m.lora_alpha, hf, loaded.params)
        _write_json(tmp / PEFT_CONFIG, {"base_model_name_or_path": base, **fields})
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / name)
    _write_json(tmp / PRIVACY_FILE, privacy)
    text = _card(privacy, merged=merge, base=base, kind=m.kind)
    (tmp / CARD_FILE).write_text(text, encoding="utf-8")
