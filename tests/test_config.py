"""Run configuration: validation in one place, and a documented key table that cannot rot."""

import dataclasses
import re
from pathlib import Path

import pytest

from dpmp.app import config as config_lib
from dpmp.app import config_reference as reference
from dpmp.app.config import Config, ConfigError, load_config
from dpmp.models.families import FAMILIES

KEYS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
ALL_KEYS = {"policy"} | {
    f"{section}.{f.name}"
    for section, cls in config_lib._SECTIONS.items()
    for f in dataclasses.fields(cls)
}


def _readme_block() -> str:
    text = KEYS_PAGE.read_text()
    begin, end = "<!-- config-keys:begin -->\n", "<!-- config-keys:end -->"
    assert begin in text and end in text, "docs/cli.md has lost its config-keys markers"
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_every_config_field_has_a_documented_row():
    rows = reference.config_reference()
    assert len(rows) == len(ALL_KEYS) and {r["key"] for r in rows} == ALL_KEYS
    for row in rows:  # each field needs a "name: meaning" entry in its class docstring
        assert row["meaning"] and row["allowed"] and row["default"], row


def test_readme_key_table_is_the_generated_one():
    block = _readme_block()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", block, re.M))
    assert listed == ALL_KEYS, f"missing {ALL_KEYS - listed}, stale {listed - ALL_KEYS}"
    assert block == reference.markdown_table(), (
        "docs/cli.md's config key table is out of date: paste the output of "
        "`python -m dpmp.app.config_reference` between its config-keys markers"
    )


def test_table_defaults_are_the_dataclass_defaults():
    rows = {r["key"]: r["default"] for r in reference.config_reference()}
    assert rows["training.steps"] == str(Config().training.steps)
    assert rows["privacy.delta"] == "1e-5" and rows["privacy.noise_multiplier"] == "unset"
    assert rows["model.hidden"] == "[256]" and rows["data.standardize"] == '"none"'
    assert rows["privacy.reproducible_noise"] == "false"
    assert rows["policy"] == '"bf16"'
    choices = {r["key"]: r["allowed"] for r in reference.config_reference()}
    assert choices["model.kind"].startswith(", ".join(f'"{k}"' for k in FAMILIES.names()))
    assert "package.module:factory" in choices["model.kind"]
    assert choices["privacy.clip_method"] == ", ".join(f'"{k}"' for k in config_lib.CLIP_METHODS)


@pytest.mark.parametrize("kind", ["pkg.mod:factory", "mod:make_model", "a.b.c:f"])
def test_model_kind_takes_a_factory(kind):
    assert load_config(None, [f"model.kind={kind}"]).model.kind == kind


@pytest.mark.parametrize("kind", ["mod:", ":f", "mod:f:g", "1mod:f", "resnet"])
def test_model_kind_refuses_other_words_naming_the_factory_form(kind):
    with pytest.raises(ConfigError, match="model.kind.*'package.module:factory'"):
        load_config(None, [f"model.kind={kind}"])


def test_physical_batch_size_must_be_a_multiple_of_the_microbatch():
    config = load_config(None, ["training.physical_batch_size=64", "training.microbatch_size=16"])
    assert config.training.physical_batch_size == 64
    with pytest.raises(ConfigError, match="training.microbatch_size: 24 must divide"):
        load_config(None, ["training.physical_batch_size=64", "training.microbatch_size=24"])
    with pytest.raises(ConfigError, match="training.physical_batch_size: must be finite and > 0"):
        load_config(None, ["training.physical_batch_size=0"])


def test_a_dynamic_initial_scale_must_lie_within_its_bounds():
    with pytest.raises(ConfigError, match=r"loss_scale.initial: 1e\+30 is outside"):
        load_config(None, ["loss_scale.kind=private_dynamic", "loss_scale.initial=1e30"])
    # a static scale has no bounds to respect
    assert load_config(None, ["loss_scale.kind=static", "loss_scale.initial=1e30"])


def test_defaults_evaluate_periodically():
    # the accuracy-against-epsilon plot of the default run has a curve, not a point
    t = Config().training
    assert 0 < t.eval_every < t.steps and t.steps // t.eval_every >= 10
    assert t.eval_every % t.log_every == 0  # evaluations are recorded on log steps only


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["training.seed=-1"], "training.seed: must be an integer in [0, 2^32 - 1]"),
        (["training.seed=4294967296"], "training.seed: must be an integer in [0, 2^32 - 1]"),
        (["data.standardize=1"], "data.standardize: 1 is not allowed; allowed: none, private"),
        (["data.standardize=mean"], "data.standardize: 'mean' is not allowed"),
        (["data.standardize_clip=0"], "data.standardize_clip: must be finite and > 0"),
        (["privacy.reproducible_noise=1"], "privacy.reproducible_noise: must be true or false"),
        (["data.path=[1]"], "data.path: must be a string"),
        (["privacy.accountant=moments"], "privacy.accountant: 'moments' is not allowed"),
        (["training.stepz=1"], "unknown key training.stepz"),
    ],
)
def test_validation_names_the_field(overrides, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        load_config(None, overrides)


@pytest.mark.parametrize("old", ["true", "false"])
def test_the_old_boolean_standardize_names_the_allowed_values(old):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.standardize={old}"])
    message = str(e.value)
    assert message.startswith(f"data.standardize: {old} is no longer allowed")
    assert '"none", "private", "nonprivate"' in message and "NOT differentially private" in message


def test_default_reads_no_statistic_and_draws_secret_noise():
    c = Config()
    assert c.data.standardize == "none" and c.privacy.reproducible_noise is False


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("training = 3\n")
    with pytest.raises(ConfigError, match="training: expected a table of keys"):
        load_config(path)
    with pytest.raises(ConfigError, match="training: expected a table of keys"):
        load_config(path, ["training.steps=3"])
    path.write_bytes(b"\xff")
    with pytest.raises(ConfigError, match="c.toml is not valid TOML .not UTF-8"):
        load_config(path)


def test_toml_ints_become_floats_where_floats_are_expected(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[privacy]\ntarget_epsilon = 4\n[loss_scale]\ninitial = 1024\n")
    cfg = load_config(path)
    assert cfg.privacy.target_epsilon == 4.0 and isinstance(cfg.privacy.target_epsilon, float)
    assert cfg == load_config(None, ["privacy.target_epsilon=4", "loss_scale.initial=1024"])


# Numeric keys whose huge values are harmless (a period that never comes, a
# learning rate that diverges and fails the run) or are checked against the
# data and the machine when the step is built (tests/test_cli.py).
_HUGE_IS_FINE = {
    "data.standardize_clip",
    "model.lora_rank",
    "model.lora_alpha",
    "privacy.l2_clip_norm",
    "training.expected_batch_size",
    "training.learning_rate",
    "training.microbatch_size",
    "training.physical_batch_size",
    "training.eval_every",
    "training.log_every",
    "training.checkpoint_every",
    "loss_scale.initial",
    "loss_scale.period",
    "loss_scale.factor",
    "loss_scale.max_scale",
    "pretrain.learning_rate",
}


def _numeric_keys():
    from dpmp.app.config_reference import config_reference

    return [
        row["key"]
        for row in config_reference()
        if row["allowed"].startswith(("number", "integer", "list of integers"))
    ]


def test_every_numeric_key_is_range_checked_at_its_extremes():
    """Each numeric key refuses -1, NaN, inf and 1e39 (beyond float32) with an
    error naming it, and 10^11 unless its table says it is harmless; nothing
    else is allocated or computed by load_config."""
    keys = _numeric_keys()
    assert len(keys) >= 30 and set(_HUGE_IS_FINE) <= set(keys)
    for key in keys:
        wrap = (lambda v: f"[{v}]") if key == "model.hidden" else str
        for bad in ("-1", "nan", "inf", "1e39"):
            with pytest.raises(ConfigError, match=re.escape(key)):
                load_config(None, [f"{key}={wrap(bad)}"])
        huge = [f"{key}={wrap(10**11)}"]
        if key in _HUGE_IS_FINE:
            load_config(None, huge)
        else:
            with pytest.raises(ConfigError, match=re.escape(key)):
                load_config(None, huge)


def test_the_limits_mirrored_from_accounting_agree_with_it():
    """config.py keeps dpmp.accounting's limits as literals (it does not import the
    accountant); they must say the same."""
    from dpmp import accounting
    from dpmp.app import config

    assert config.MAX_EPSILON == accounting.MAX_EPSILON
    low, high = config.NOISE_RANGE
    assert high == accounting.MAX_NOISE_MULTIPLIER and low == 1 / high
    load_config(None, [f"training.steps={accounting.MAX_STEPS}"])
    with pytest.raises(ConfigError, match="training.steps"):
        load_config(None, [f"training.steps={accounting.MAX_STEPS + 1}"])
