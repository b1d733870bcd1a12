"""``dpmp export RUN_DIR --format hf [--merge]`` (``dpmp.app.export_hf``): a run of a
checkpoint's model as a folder ``transformers`` loads, or a PEFT adapter, with
``privacy.json`` and a model card.

The fast tests export finished runs written here (a tiny random checkpoint
saved by ``save_decoder``, trained parameters in a checkpoint, a
``report.json`` of distinct numbers) and check the files against NumPy: the
merged weights are ``W + alpha / r (A B)^T`` in float64, rounded once to the
stored dtype; the adapter holds ``A^T`` and ``B^T`` under PEFT's names.
``privacy.json``'s numbers are the report's. The slow ones load the exports
in ``transformers`` and ``peft`` (skipped where they are not installed),
check PEFT's own saved layout, and round-trip a private LoRA run trained
through the command line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from dpmp.app import cli
from dpmp.app.checkpoint import save_checkpoint
from dpmp.app.config import load_config
from dpmp.app.release import public_config
from dpmp.app.trainer.pretrain import params_digest
from dpmp.models import init_adapters, load_decoder, save_decoder
from dpmp.models._params_file import param_names
from dpmp.models.families._decoder import decoder_config_from_json, decoder_init
from tests.test_decoder import CONFIGS, F32_TOL
from tests.test_decoder_app import TINY, _argv
from tests.test_decoder_app import _checkpoint as _f32_checkpoint
from tests.test_gpt2 import WORDS

U32 = 2.0**-24  # unit roundoff of float32
UNIT = {np.dtype(np.float32): U32, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
# distinct released numbers, each findable in privacy.json
REPORT = {
    "private": True,
    "privacy_warnings": [],
    "neighbouring_relation": "zero-out: one record replaced by a null record",
    "epsilon": 1.2345,
    "target_epsilon": 2.5,
    "delta": 3e-6,
    "accountant": "pld",
    "noise_multiplier": 0.875,
    "l2_clip_norm": 0.625,
    "steps": 7,
    "noise": {"sampler": "snapped", "epsilon_residual": 4.5e-9, "l2_sensitivity": 0.6251},
    "sampling": {"kind": "poisson", "sampling_prob": 0.0625, "expected_batch_size": 4},
    "audit": {"ok": True, "violations": [], "missing": [], "counts": {"norm": 3}},
    "policy": "f32",
    "versions": {"dpmp": "0.1.0"},
}
SECRETS = ("seed", "key", "fingerprint", "sha256", "private/", "checkpoints")


def _checkpoint(folder, family, dtype=np.float32, shard_bytes=None):
    """A tiny random ``family`` checkpoint stored in ``dtype`` (sharded if asked)."""
    if dtype == np.float32 and shard_bytes is None:
        return _f32_checkpoint(folder, family)
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = decoder_config_from_json(CONFIGS[family] | TINY)
    params = jax.tree.map(lambda x: x.astype(dtype), decoder_init(config, jax.random.key(0)))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return save_decoder(folder, params, config, tokenizer, shard_bytes=shard_bytes)


def _fake_run(tmp_path, folder, kind, *, rank=2, alpha=6.0, report=None, run="run", targets=()):
    """A finished run of ``kind`` over ``folder``: random trained parameters (LoRA
    adapters with a nonzero B, or with ``rank = 0`` every weight moved) in its
    checkpoint, and a report of ``REPORT``'s numbers (``report`` overrides)."""
    config = load_config(
        None,
        [f"model.kind={kind}", f'model.checkpoint="{folder}"', f"model.lora_rank={rank}"]
        + [f"model.lora_alpha={alpha}", f"model.lora_targets={json.dumps(list(targets))}"],
    )
    from dpmp.app.published import load_checkpoint

    base = load_checkpoint(kind, folder, "f32").params
    rng = np.random.default_rng(5)
    if rank:
        trained = init_adapters(base, rank, jax.random.key(1), tuple(targets))
        for ab in trained.values():
            ab["b"] = jnp.asarray(0.3 * rng.standard_normal(ab["b"].shape), jnp.float32)
    else:  # the trainer's float32 masters
        trained = jax.tree.map(
            lambda w: jnp.asarray(w, jnp.float32) + 0.05 * rng.standard_normal(w.shape), base
        )
        trained = jax.tree.map(lambda w: w.astype(jnp.float32), trained)
    path = tmp_path / run
    n = len(jax.tree.leaves(trained))
    save_checkpoint(path / "checkpoints", step=7, state=trained, meta={"params_leaves": [0, n]})
    start = {"source": f"public pre-trained {folder.name}", "params_sha256": params_digest(base)}
    full = REPORT | {"config": public_config(config), "starting_point": start} | (report or {})
    (path / "report.json").write_text(json.dumps(full))
    return path, base, trained


def _export(run, *extra):
    return cli.main(["export", str(run), "--format", "hf", *extra])


def _numbers(tree):
    """Every number of a JSON tree (booleans not counted)."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in _numbers(v)]
    return [tree] if isinstance(tree, int | float) and not isinstance(tree, bool) else []


def _check_public(out, tmp_path, released):
    """privacy.json's numbers are released ones; no export file names a secret or a path."""
    privacy = json.loads((out / "privacy.json").read_text())
    assert set(_numbers(privacy)) <= set(_numbers(released)), privacy
    for name in ("privacy.json", "README.md", "adapter_config.json"):
        if (out / name).is_file():
            text = (out / name).read_text()
            assert str(tmp_path) not in text, name
            assert not [s for s in SECRETS if s in text.lower()], (name, text)
    return privacy


def test_an_adapter_holds_peft_names_and_the_transposed_adapters(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "ckpt", "llama")
    run, base, adapters = _fake_run(tmp_path, folder, "llama", rank=2, alpha=6.0)
    assert _export(run, "--checkpoint", str(folder)) == 0
    out = run / "hf"
    assert str(out) in capsys.readouterr().out
    files = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"}
    assert {p.name for p in out.iterdir()} == files | {"privacy.json", "README.md"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2
    assert config["lora_alpha"] / config["r"] == 6.0 / 2  # dpmp's scale
    assert config["base_model_name_or_path"] == folder.name and not config["fan_in_fan_out"]
    kernels = {n for n in param_names(base) if n.endswith(".kernel")}
    assert set(config["target_modules"]) == {n.split(".")[-2] for n in kernels}
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(kernels)
    for name in kernels:  # PEFT: lora_A [r, in], lora_B [out, r], delta = s B A
        module = ("" if name.startswith("lm_head") else "model.") + name.removesuffix(".kernel")
        ab = adapters[name.replace(".", "/")]
        got_a = tensors[f"base_model.model.{module}.lora_A.weight"]
        got_b = tensors[f"base_model.model.{module}.lora_B.weight"]
        np.testing.assert_array_equal(got_a, np.asarray(ab["a"]).T)
        np.testing.assert_array_equal(got_b, np.asarray(ab["b"]).T)
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    _check_public(out, tmp_path, json.loads((run / "report.json").read_text()))


def test_an_adapter_of_some_targets_names_them_and_a_merge_keeps_the_others(tmp_path):
    """model.lora_targets = ["q_proj", "v_proj"]: PEFT's target_modules are those two,
    the adapter holds their tensors alone, and the merged folder's other weights are
    the checkpoint's, bit for bit."""
    folder = _checkpoint(tmp_path / "ckpt", "llama")
    targets = ("q_proj", "v_proj")
    run, base, adapters = _fake_run(tmp_path, folder, "llama", targets=targets)
    assert _export(run, "--checkpoint", str(folder)) == 0
    config = json.loads((run / "hf" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(targets)
    tensors = load_file(str(run / "hf" / "adapter_model.safetensors"))
    assert {k.split(".")[-3] for k in tensors} == set(targets)
    assert len(tensors) == 2 * len(adapters)
    assert _export(run, "--checkpoint", str(folder), "--merge") == 0
    merged = load_file(str(run / "hf-merged" / "model.safetensors"))
    stored = load_file(str(folder / "model.safetensors"))
    assert merged.keys() == stored.keys()
    for key, value in stored.items():
        changed = not np.array_equal(merged[key], value)
        assert changed == any(f".{t}." in key for t in targets), key


def _at(tree, name):
    for part in name.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize(
    "family, dtype, shard_bytes, rank",
    [
        ("llama", np.float32, None, 2),
        ("qwen2", ml_dtypes.bfloat16, 600, 3),
        ("gemma", np.float32, None, 0),
    ],
)
def test_merged_weights_keep_the_checkpoints_names_dtypes_and_shards(
    tmp_path, family, dtype, shard_bytes, rank
):
    folder = _checkpoint(tmp_path / "ckpt", family, dtype, shard_bytes)
    run, base, trained = _fake_run(tmp_path, folder, family, rank=rank, alpha=6.0)
    out = tmp_path / "merged"
    assert _export(run, "--merge", "--checkpoint", str(folder), "--out", str(out)) == 0
    weights = sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model")) == weights
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    moved = 0
    for file in (w for w in weights if w.endswith(".safetensors")):
        source, got = load_file(str(folder / file)), load_file(str(out / file))
        assert set(got) == set(source), file
        for key, stored in source.items():
            assert got[key].dtype == stored.dtype and got[key].shape == stored.shape, key
            want = _merged_float64(key, stored, base, trained, rank, alpha=6.0)
            if want is None:  # not trained: the stored tensor, bit for bit
                np.testing.assert_array_equal(got[key], stored, err_msg=key)
                continue
            want, bound = want
            # the float32 sum (rank + 2 roundings) and the one rounding to the stored dtype
            tol = (UNIT[stored.dtype] + (rank + 2) * U32) * bound
            err = np.abs(got[key].astype(np.float64) - want)
            assert (err <= tol).all(), (key, err.max())
            moved += int(np.abs(want - stored.astype(np.float64)).max() > 0)
    assert moved > 0


def _merged_float64(key, stored, base, trained, rank, alpha):
    """``(the trained value in float64, a bound of its terms' magnitudes)`` of the
    stored tensor ``key`` (None: training leaves it as stored)."""
    name = key.removeprefix("model.").removesuffix(".weight")
    leaf = {"embed_tokens": "embedding", "norm": "scale"}.get(name.split(".")[-1], "kernel")
    if "layernorm" in name:
        leaf = "scale"
    if key.endswith(".bias"):
        name, leaf = key.removeprefix("model.").removesuffix(".bias"), "bias"
    param = f"{name}.{leaf}"
    if not rank:  # every parameter trained: its float32 master, in the stored layout
        value = np.asarray(_at(trained, param), np.float64)
        value = value.T if leaf == "kernel" else value
        return value, np.abs(value)
    if leaf != "kernel":
        return None
    ab = trained[param.replace(".", "/")]
    a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
    w = stored.astype(np.float64)
    delta = (alpha / rank * a @ b).T
    return w + delta, np.abs(w) + alpha / rank * (np.abs(a) @ np.abs(b)).T


def test_privacy_json_holds_the_reports_released_numbers_and_the_search(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", "llama")
    run, _, _ = _fake_run(tmp_path, folder, "llama")
    assert _export(run, "--checkpoint", str(folder)) == 0
    report = json.loads((run / "report.json").read_text())
    privacy = _check_public(run / "hf", tmp_path, report)
    assert privacy["private"] is True and privacy["tuning_search"] is None
    for key in ("epsilon", "delta", "accountant", "steps", "l2_clip_norm", "noise_multiplier"):
        assert privacy[key] == report[key], key
    assert privacy["noise_sampler"] == report["noise"]["sampler"]
    assert privacy["noise_residual_epsilon"] == report["noise"]["epsilon_residual"]
    assert privacy["sampling"]["sampling_prob"] == report["sampling"]["sampling_prob"]
    assert privacy["precision_audit"]["ok"] is True and "record" in privacy["privacy_unit"]
    card = (run / "hf" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n") and "(1.2345, 3e-06)" in card

    # the run dpmp tune chose: the guarantee is the whole search's (tune.json)
    search = tmp_path / "search"
    best, _, _ = _fake_run(tmp_path, folder, "llama", run="search/best")
    tune = {"private": True, "privacy_warnings": [], "epsilon": 2.25, "delta": 4e-6}
    tune |= {"chosen": {"run_dir": "best"}, "accounting": {"method": "random stopping"}}
    (search / "tune.json").write_text(json.dumps(tune))
    for given in (search, best):
        out = tmp_path / f"from-{given.name}"
        assert _export(given, "--checkpoint", str(folder), "--out", str(out)) == 0
        privacy = _check_public(out, tmp_path, [report, tune])
        assert (privacy["epsilon"], privacy["delta"]) == (2.25, 4e-6)
        assert privacy["tuning_search"]["run_epsilon"] == report["epsilon"]


def _refused(capsys, argv, needle):
    assert _export(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp export: error: "), err
    assert needle in err, err


def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "ckpt", "llama")
    given = ["--checkpoint", str(folder)]
    _refused(capsys, [tmp_path / "nope"], "no such run directory")
    (tmp_path / "empty").mkdir()
    _refused(capsys, [tmp_path / "empty"], "report.json not found (the run has not finished)")
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    report = REPORT | {"config": public_config(load_config(None, []))}
    (mlp / "report.json").write_text(json.dumps(report))
    _refused(capsys, [mlp], "a Hugging Face export needs a run of model.kind = ")
    full, _, _ = _fake_run(tmp_path, folder, "llama", rank=0, run="full")
    _refused(capsys, [full, *given], "a full fine-tune has no LoRA adapters")
    run, _, _ = _fake_run(tmp_path, folder, "llama")
    _refused(capsys, [run], "give the folder with --checkpoint DIR")
    other = _f32_checkpoint(tmp_path / "other", "llama")  # the same shapes, other weights
    config = load_decoder(other).config
    save_decoder(other, decoder_init(config, jax.random.key(9)), config)
    _refused(capsys, [run, "--checkpoint", str(other)], "holds other weights than the run")
    assert _export(run, *given) == 0
    _refused(capsys, [run, *given], "exists; choose another folder, or --force")
    assert _export(run, *given, "--force") == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    out = ["--out", str(tmp_path / "mine"), "--force"]
    _refused(capsys, [run, *given, *out], "is not an export (no privacy.json)")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert cli.main(["export", str(run), "--merge"]) == 2
    assert "--merge: only with --format hf" in capsys.readouterr().err

    warned = {"private": False, "privacy_warnings": ["privacy.delta = 0.5 is not below 1/n"]}
    loose, _, _ = _fake_run(tmp_path, folder, "llama", report=warned, run="loose")
    _refused(capsys, [loose, *given], "this run is NOT differentially private")
    assert not (loose / "hf").exists()
    assert _export(loose, *given, "--allow-not-private") == 0
    privacy = json.loads((loose / "hf" / "privacy.json").read_text())
    assert privacy["private"] is False and privacy["privacy_warnings"] == warned["privacy_warnings"]
    assert "NOT differentially private" in (loose / "hf" / "README.md").read_text()
    assert not list(tmp_path.rglob(".*.tmp-*"))  # no half-written folder left


# ---- in transformers and peft ---------------------------------------------------------

TOKENS = np.array([[2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]])


def _torch_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy().astype(np.float64)


def _close(got, want, what):
    """Float32 logits of two implementations of the same network: within
    ``F32_TOL`` (``tests/test_decoder.py``: ~20 roundings in sequence, each of a sum
    of at most 64 terms) of the largest logit."""
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= F32_TOL * scale, (what, err, scale)


def _hf_checkpoint(tmp_path, family):
    if family != "gpt2":
        return _checkpoint(tmp_path / "ckpt", family)
    from tests.test_gpt2 import _tensors, _write

    return _write(tmp_path / "ckpt", _tensors(np.random.default_rng(4)))


def _dpmp_logits(family, folder, adapters, rank, alpha):
    """dpmp's fine-tuned model in float32: the checkpoint's model with the adapters
    beside its weights (``lora_model``: ``x W + s (x A) B``, not the merged weights)."""
    from dpmp.app.published import load_checkpoint
    from dpmp.models._lora import lora_model

    loaded = load_checkpoint(family, folder, "f32")
    model = lora_model(loaded.model, loaded.params, rank=rank, alpha=alpha)
    return np.asarray(model.predict(adapters, TOKENS), np.float64)


@pytest.mark.slow  # importing torch, transformers and peft: ~15 s
@pytest.mark.filterwarnings("ignore::UserWarning")  # peft's notes on saving a tied head
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
def test_exports_load_in_transformers_and_peft_as_dpmps_model(tmp_path, family):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = _hf_checkpoint(tmp_path, family)
    run, _, adapters = _fake_run(tmp_path, folder, family, rank=2, alpha=6.0)
    given = ["--checkpoint", str(folder)]
    assert _export(run, *given) == 0 and _export(run, *given, "--merge") == 0
    want = _dpmp_logits(family, folder, adapters, rank=2, alpha=6.0)

    def base():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    assert np.abs(_torch_logits(base(), TOKENS) - want).max() > 1e-2  # the adapters matter
    merged = AutoModelForCausalLM.from_pretrained(run / "hf-merged", dtype=torch.float32)
    _close(_torch_logits(merged, TOKENS), want, "merged")
    adapted = PeftModel.from_pretrained(base(), run / "hf")
    _close(_torch_logits(adapted, TOKENS), want, "peft")

    # PEFT's own adapter of the same settings has the same tensors, named and shaped alike
    fields = json.loads((run / "hf" / "adapter_config.json").read_text())
    keys = ("r", "lora_alpha", "target_modules", "fan_in_fan_out")
    own = get_peft_model(base(), LoraConfig(**{k: fields[k] for k in keys}))
    own.save_pretrained(tmp_path / "peft-own")
    theirs = load_file(str(tmp_path / "peft-own" / "adapter_model.safetensors"))
    ours = load_file(str(run / "hf" / "adapter_model.safetensors"))
    theirs = {k: v.shape for k, v in theirs.items() if ".base_layer." not in k}
    assert {k: v.shape for k, v in ours.items()} == theirs


@pytest.mark.slow  # a private LoRA run through the CLI (~25 s) and torch (~15 s)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_private_lora_run_round_trips_through_transformers_and_peft(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dpmp.app.checkpoint import load_params

    folder = _checkpoint(tmp_path / "ckpt", "llama")
    assert cli.main(_argv(tmp_path, "llama", folder, "--set", "model.lora_alpha=16")) == 0
    run = tmp_path / "run"
    report = json.loads((run / "report.json").read_text())
    given = ["--checkpoint", str(folder)]
    assert _export(run, *given) == 0 and _export(run, *given, "--merge") == 0
    capsys.readouterr()
    for out in (run / "hf", run / "hf-merged"):
        privacy = _check_public(out, tmp_path, report)
        assert privacy["epsilon"] == report["epsilon"] and privacy["private"] is True
        texts = " ".join(p.read_text() for p in out.glob("*.json"))
        assert report["starting_point"]["params_sha256"] not in texts

    base = load_decoder(folder, "f32").params
    like = jax.eval_shape(lambda k: init_adapters(base, 2, k), jax.random.key(0))
    adapters = load_params(run, like)
    want = _dpmp_logits("llama", folder, adapters, rank=2, alpha=16.0)
    merged = AutoModelForCausalLM.from_pretrained(run / "hf-merged", dtype=torch.float32)
    _close(_torch_logits(merged, TOKENS), want, "merged")
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert np.abs(_torch_logits(original, TOKENS) - want).max() > F32_TOL * np.abs(want).max()
    adapted = PeftModel.from_pretrained(original, run / "hf")
    _close(_torch_logits(adapted, TOKENS), want, "peft")


@pytest.mark.slow  # torch, and transformers' own models
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", ["llama-f32", "qwen2-tied-f32", "gemma-f32", "llama-tied-bf16"])
def test_folders_transformers_saved_export_in_their_own_layout(tmp_path, case):
    """A sharded folder ``save_pretrained`` wrote (``config.json`` in transformers
    5's form, ``generation_config.json``): the merged export keeps its shards,
    names and dtype, and both exports equal dpmp's model in ``transformers``."""
    pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_decoder import BF16_TOL
    from tests.test_decoder_transformers import _hf_model

    folder = tmp_path / "ckpt"
    _hf_model(case).save_pretrained(folder, max_shard_size="40KB")
    family = case.split("-")[0]
    run, _, adapters = _fake_run(tmp_path, folder, family, rank=2, alpha=6.0)
    given = ["--checkpoint", str(folder)]
    assert _export(run, *given) == 0 and _export(run, *given, "--merge") == 0
    out = run / "hf-merged"
    shards = sorted(p.name for p in folder.glob("model*"))
    assert len(shards) > 2 and sorted(p.name for p in out.glob("model*")) == shards
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    for shard in (s for s in shards if s.endswith(".safetensors")):
        source, got = load_file(str(folder / shard)), load_file(str(out / shard))
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in source.items()}
    want = _dpmp_logits(family, folder, adapters, rank=2, alpha=6.0)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if case.endswith("-bf16"):  # the merged weights rounded once to bfloat16
        got = _torch_logits(merged, TOKENS)
        assert np.abs(got - want).max() <= BF16_TOL * np.abs(want).max()
    else:
        _close(_torch_logits(merged, TOKENS), want, "merged")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _close(_torch_logits(PeftModel.from_pretrained(base, run / "hf"), TOKENS), want, "peft")
