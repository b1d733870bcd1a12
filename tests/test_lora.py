"""LoRA and public pre-training: the adapters are exactly what is trained, clipped,
noised and accounted; the frozen parameters come out bit for bit as they went in."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.app.checkpoint import CheckpointError, latest_meta
from dpmp.app.config import ConfigError, load_config
from dpmp.app.inputs import load_data, model_from_config
from dpmp.app.trainer import build_private_step, train
from dpmp.models._lora import adapted, lora_model
from dpmp.models._model import Model, count_params, wrap_forward

from ._reference import flat


def _base():
    k = jax.random.split(jax.random.key(1), 4)
    return {
        "dense": {"kernel": jax.random.normal(k[0], (6, 5)), "bias": jnp.arange(5.0)},
        "attn": {"query": {"kernel": jax.random.normal(k[1], (8, 2, 4))}},
        "out": {"kernel": jax.random.normal(k[2], (2, 4, 8))},
        "embed": {"embedding": jax.random.normal(k[3], (10, 8))},
    }


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_merge_is_w_plus_scaled_low_rank_product_against_float64():
    base = _base()
    adapters = dpmp.init_lora(base, 3, jax.random.key(0))
    # B starts at zero; give it values so that the product is not trivially zero
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)
    merged = dpmp.merge_lora(base, adapters, alpha=6.0)
    shapes = {
        "dense/kernel": ((6, 3), (3, 5)),
        "attn/query/kernel": ((8, 3), (3, 8)),  # [8, 2, 4] seen as 8 x 8
        "out/kernel": ((8, 3), (3, 8)),  # [2, 4, 8] seen as 8 x 8
    }
    assert {k: (v["a"].shape, v["b"].shape) for k, v in adapters.items()} == shapes
    for name in shapes:
        a = np.asarray(adapters[name]["a"], np.float64)
        b = np.asarray(adapters[name]["b"], np.float64)
        node_base, node_merged = base, merged
        for part in name.split("/"):
            node_base, node_merged = node_base[part], node_merged[part]
        want = np.asarray(node_base, np.float64) + 6.0 / 3 * (a @ b).reshape(node_base.shape)
        np.testing.assert_allclose(np.asarray(node_merged), want, rtol=1e-6, atol=1e-6)
    # what has no adapter is the very same array
    assert np.array_equal(merged["dense"]["bias"], base["dense"]["bias"])
    assert np.array_equal(merged["embed"]["embedding"], base["embed"]["embedding"])


@pytest.mark.slow  # ~9 s on 2 cores
def test_merge_refuses_adapters_of_another_model():
    base = _base()
    adapters = dpmp.init_lora(base, 2, jax.random.key(0))
    del adapters["out/kernel"]
    with pytest.raises(ValueError, match=r"missing \['out/kernel'\]"):
        dpmp.merge_lora(base, adapters, alpha=1.0)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_a_bad_rank_is_refused(rank):
    with pytest.raises(ValueError, match="model.lora_rank"):
        dpmp.init_lora(_base(), rank, jax.random.key(0))


def test_a_model_without_weight_matrices_is_refused():
    with pytest.raises(ValueError, match="no weight matrix"):
        dpmp.init_lora({"bias": jnp.zeros(3)}, 2, jax.random.key(0))


def _lm_config(tmp_path, *sets):
    private = tmp_path / "private.txt"
    private.write_text("\n".join(f"record {i}: {'ab' * (i % 7)} {i * 37 % 101}" for i in range(64)))
    public = tmp_path / "public.txt"
    public.write_text("\n".join(f"public line {i} {'xy' * (i % 5)}" for i in range(80)))
    return load_config(
        None,
        [
            "data.dataset=text",
            f"data.path={json.dumps(str(private))}",
            "data.seq_len=12",
            "model.kind=lm",
            "model.dim=16",
            "model.depth=1",
            "model.heads=2",
            "privacy.target_epsilon=8",
            "training.steps=3",
            "training.expected_batch_size=16",
            "training.eval_every=0",
            "training.checkpoint_every=2",
            "pretrain.dataset=text",
            f"pretrain.path={json.dumps(str(public))}",
            "pretrain.steps=4",
            "pretrain.batch_size=8",
            *sets,
        ],
    )


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_adapters_start_as_the_base_model_and_are_all_that_is_noised(tmp_path):
    config = _lm_config(tmp_path, "model.lora_rank=2")
    data = load_data(config.data, 0)
    model = model_from_config(config.model, data, config.precision)
    base = jax.jit(model.init)(jax.random.key(3))
    adapted_model = lora_model(model, base, rank=2, alpha=8.0)
    adapters = adapted_model.init(jax.random.key(4))
    batch = {"x": jnp.asarray(data.x_train[:4]), "y": jnp.asarray(data.y_train[:4])}
    with_adapters = jax.jit(adapted_model.loss_fn)(adapters, batch)
    assert with_adapters == jax.jit(model.loss_fn)(base, batch)

    step = build_private_step(config, data, init_params=base)
    # rank 2 x (fan_in + fan_out): query, key, value [16, 2, 8] and out [2, 8, 16]
    # as 16 x 16, the MLP's 16 x 64 and 64 x 16, the head's 16 x 258
    expected = 2 * (4 * 32 + 2 * 80 + 274)
    assert len(adapted(base)) == 7
    assert count_params(step.init_state["params"]) == expected < count_params(base) / 3
    assert step.plan.budget.noised_coordinates == expected
    params, *_ = jax.eval_shape(step.step_fn, *step.example_args)
    assert jax.tree.structure(params) == jax.tree.structure(step.init_state["params"])


@pytest.mark.slow  # public pre-training and private runs, ~40 s
def test_lora_after_public_pretraining_leaves_the_base_bit_identical(tmp_path):
    config = _lm_config(tmp_path, "model.lora_rank=2")
    out = tmp_path / "run"
    report = train(config, out_dir=out, progress=False)
    start = report["starting_point"]
    assert start["source"].startswith("pretrained on public text") and start["steps"] == 4
    assert report["model"]["name"].endswith("LoRA rank 2")
    model = model_from_config(config.model, load_data(config.data, 0), config.precision)
    like = jax.eval_shape(model.init, jax.random.key(0))
    pretrained = dpmp.load_params(out / "pretrained", like)
    adapters = dpmp.load_params(out, dpmp.init_lora(like, 2, jax.random.key(0)))
    assert report["num_params"] == count_params(adapters)
    merged = dpmp.merge_lora(pretrained, adapters, alpha=config.model.lora_alpha)
    leaves = jax.tree_util.tree_flatten_with_path(pretrained)[0]
    frozen = 0
    for (path, before), after in zip(leaves, jax.tree.leaves(merged)):
        if path[-1].key == "kernel":
            assert not np.array_equal(before, after)  # adapted
        else:  # frozen: embeddings, positions, norms, biases
            assert np.array_equal(np.asarray(before), np.asarray(after)), path
            frozen += 1
    assert frozen >= 8
    from dpmp.app.trainer.pretrain import params_digest

    assert params_digest(pretrained) == start["params_sha256"]

    # the pre-training is reused by a resumed run
    report2 = train(config, out_dir=out, progress=False)
    assert report2["steps"] == 3
    log = (out / "train.log").read_text()
    assert "public pre-training: reused pretrained/" in log
    # other public text at the same path: pre-trained again, and the run refuses
    # to continue adapting other parameters than it started with
    public = tmp_path / "public.txt"
    public.write_text(public.read_text().replace("public", "other"))
    with pytest.raises(CheckpointError, match="other starting parameters"):
        train(config, out_dir=out, progress=False)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_init_params_start_a_full_fine_tuning(tmp_path):
    config = _lm_config(tmp_path, "pretrain.dataset=none", "training.steps=1")
    data = load_data(config.data, 0)
    model = model_from_config(config.model, data, config.precision)
    start = jax.jit(model.init)(jax.random.key(7))
    step = build_private_step(config, data, init_params=start)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(step.init_state["params"]), jax.tree.leaves(start))
    )
    with pytest.raises(ValueError, match="init_params: leaf"):
        bad = jax.tree.map(lambda x: x[..., :1] if x.ndim else x, start)
        build_private_step(config, data, init_params=bad)


@pytest.mark.slow  # a private run, ~20 s
def test_a_run_says_it_started_from_given_parameters(tmp_path):
    config = _lm_config(tmp_path, "pretrain.dataset=none", "training.steps=1")
    model = model_from_config(config.model, load_data(config.data, 0), config.precision)
    start = jax.jit(model.init)(jax.random.key(7))
    report = train(config, out_dir=tmp_path / "ft", init_params=start, progress=False)
    assert report["starting_point"]["source"] == "init_params given to dpmp.train"
    with pytest.raises(ValueError, match="pre-train it yourself and pass init_params"):
        train(_lm_config(tmp_path), out_dir=tmp_path / "x", init_params=start, progress=False)


def test_pretraining_config_errors():
    with pytest.raises(ConfigError, match="pretrain.dataset.*model.kind = 'lm'"):
        load_config(None, ["pretrain.dataset=python_stdlib"])
    with pytest.raises(ConfigError, match="pretrain.path: required"):
        load_config(None, ["model.kind=lm", "pretrain.dataset=text"])
    with pytest.raises(ConfigError, match="model.lora_rank"):
        load_config(None, ["model.lora_rank=-1"])
    with pytest.raises(ConfigError, match="pretrain.dataset"):
        load_config(None, ["pretrain.dataset=wikipedia"])


def test_a_missing_public_text_names_pretrain_path(tmp_path):
    config = _lm_config(tmp_path, f"pretrain.path={json.dumps(str(tmp_path / 'nope.txt'))}")
    with pytest.raises(dpmp.DataError, match="pretrain.path: no such file"):
        train(config, out_dir=tmp_path / "run", progress=False)


@pytest.mark.slow  # public pre-training and private runs, ~40 s
def test_pretrained_parameters_are_remade_when_the_spec_changes(tmp_path):
    out = tmp_path / "run"
    train(_lm_config(tmp_path, "training.steps=1"), out_dir=out, progress=False)
    meta, _ = latest_meta(out / "pretrained" / "checkpoints")
    train(
        _lm_config(tmp_path, "training.steps=1", "pretrain.steps=5"),
        out_dir=out,
        resume=False,
        progress=False,
    )
    meta2, _ = latest_meta(out / "pretrained" / "checkpoints")
    assert meta2["info"]["steps"] == 5 and meta["info"]["steps"] == 4
    assert meta2["info"]["params_sha256"] != meta["info"]["params_sha256"]


def test_lora_over_a_randomly_initialised_base_is_refused(tmp_path):
    config = load_config(None, ["model.lora_rank=4", "training.steps=2"])
    with pytest.raises(ConfigError, match=r"model.lora_rank = 4: .*\[pretrain\].*init_params"):
        train(config, out_dir=tmp_path, progress=False)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "report.json").exists()


def _lora_step(tmp_path, dim, *sets, base_dtype=jnp.float32):
    """A LoRA step of the tiny language model of width ``dim`` over a random base."""
    config = _lm_config(
        tmp_path, "model.lora_rank=2", f"model.dim={dim}", "training.steps=2", *sets
    )
    data = load_data(config.data, 0)
    model = model_from_config(config.model, data, config.precision)
    base = jax.tree.map(lambda x: x.astype(base_dtype), jax.jit(model.init)(jax.random.key(3)))
    return build_private_step(config, data, init_params=base), base


def _largest_constant(text: str) -> int:
    """Characters of the longest dense constant of a StableHLO module."""
    sizes = [len(line) for line in text.splitlines() if "stablehlo.constant dense<" in line]
    return max(sizes, default=0)


@pytest.mark.slow  # two steps built and lowered, ~11 s
def test_the_frozen_base_is_an_argument_of_the_compiled_step_not_a_constant(tmp_path):
    texts = {}
    for dim in (8, 32):
        step, base = _lora_step(tmp_path, dim)
        texts[dim] = step.step_fn.lower(*step.example_args).as_text()
        # no constant as large as one of the base's weight matrices (dim x 4 dim floats)
        assert _largest_constant(texts[dim]) < 2 * 4 * dim * dim, dim
    # 16 times the base's weight matrices, hardly any more program
    assert len(texts[32]) < 1.3 * len(texts[8])


@pytest.mark.slow  # a step built, compiled and run, ~12 s
def test_a_bfloat16_base_stays_bfloat16_and_bit_identical_through_training(tmp_path):
    step, base = _lora_step(tmp_path, 8, base_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(step.model.frozen)} == {jnp.dtype(jnp.bfloat16)}
    text = step.step_fn.lower(*step.example_args).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "xbf16>" in main  # the base is an argument, in bfloat16
    params, batch, pad, opt_state, scale = step.example_args
    for _ in range(2):
        params, opt_state, scale, _ = step.step_fn(params, batch, pad, opt_state, scale)
    assert any(np.any(np.asarray(v["b"]) != 0) for v in params.values())  # it trained
    for before, after in zip(jax.tree.leaves(base), jax.tree.leaves(step.model.frozen)):
        assert after.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(before), np.asarray(after))


def _tiny_model():
    """A plain two-layer model (``dpmp.models._model.Model``) and its base."""
    policy = dpmp.Policy.parse("f32")

    def forward(p, x):
        h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
        return h @ p["out"]["kernel"]

    loss_fn, predict, metrics = wrap_forward(forward, policy)
    model = Model("classifier", "jax", "tiny", None, loss_fn, predict, metrics, "tiny")
    k = jax.random.split(jax.random.key(1), 2)
    base = {
        "dense": {"kernel": jax.random.normal(k[0], (6, 5)), "bias": jnp.arange(5.0) / 5},
        "out": {"kernel": jax.random.normal(k[1], (5, 3))},
    }
    return model, base


def _tiny_reference(base, adapters, batch, alpha, clip):
    """The tiny model's per-example clipped gradients and losses in float64, written
    out by hand (``x W + b + s (x A) B``, tanh, ``h W' + s (h A') B'``, softmax
    cross-entropy): ``(clipped [B, P], losses [B])``, adapter leaves in tree order."""
    s = alpha / adapters["dense/kernel"]["a"].shape[1]
    with jax.enable_x64(True):
        p, w = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), (adapters, base))

        def loss(p, x, y):
            d, o = p["dense/kernel"], p["out/kernel"]
            h = jnp.tanh(x @ w["dense"]["kernel"] + w["dense"]["bias"] + s * (x @ d["a"]) @ d["b"])
            return -jax.nn.log_softmax(h @ w["out"]["kernel"] + s * (h @ o["a"]) @ o["b"])[y]

        x, y = jnp.asarray(np.asarray(batch["x"], np.float64)), jnp.asarray(batch["y"])
        per = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y)
        losses = np.asarray(jax.vmap(loss, (None, 0, 0))(p, x, y))
    g = np.concatenate([np.asarray(a).reshape(len(losses), -1) for a in jax.tree.leaves(per)], 1)
    return g * np.minimum(1.0, clip / np.linalg.norm(g, axis=1))[:, None], losses


# Float32 roundings along the tiny model's arithmetic, one per term of each reduction
# a value passes through (Higham's gamma_n, summed along the path): the forward pass
# through x W (6 terms) and x A B (6, 2), h W' (5) and h A' B' (5, 2) and the softmax (3);
# a gradient coordinate goes forward and back, then through the clip norm's 38 squares
# and the batch's 8 examples; the loss goes forward, then through the batch mean.
_TINY_FORWARD = 6 + 6 + 2 + 5 + 5 + 2 + 3
_TINY_DEPTH = 2 * _TINY_FORWARD + 38 + 8


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_base_as_an_argument_gives_the_gradients_of_the_base_closed_over():
    """The frozen base passed as an argument, closed over (a constant XLA may fold
    into the program) or merged into the weights: three compiled programs of one
    clipped sum, each within its float32 rounding of a float64 reference (in L2,
    ``_TINY_DEPTH`` unit roundoffs of the summed clipped norms), so within twice that
    of each other; the same for the loss. Eagerly, the default base and the same
    base passed give the same bits (the same operations on the same machine)."""
    model, base = _tiny_model()
    lora = lora_model(model, base, rank=2, alpha=8.0)
    adapters = jax.tree.map(lambda x: x + 0.1, lora.init(jax.random.key(4)))
    x = jax.random.normal(jax.random.key(5), (8, 6))
    batch = {"x": x, "y": jnp.arange(8) % 3}

    def closed_over(p, b):  # the base a constant of the program, as a closure
        return lora.loss_fn(p, b)

    def merged(p, b):  # the model on the merged weights
        return model.loss_fn(dpmp.merge_lora(base, p, alpha=8.0), b)

    kw = {"l2_clip_norm": 0.5, "policy": "f32", "method": "vmap"}
    got = jax.jit(dpmp.private_grad(lora.loss_fn, **kw))(adapters, batch, base)
    want = jax.jit(dpmp.private_grad(closed_over, **kw))(adapters, batch)
    close = jax.jit(dpmp.private_grad(merged, **kw))(adapters, batch)
    clipped, losses = _tiny_reference(base, adapters, batch, alpha=8.0, clip=0.5)
    u = 2.0**-24  # float32's unit roundoff
    tol = _TINY_DEPTH * u * np.linalg.norm(clipped, axis=1).sum()
    for out in (got, want, close):
        assert np.linalg.norm(flat(out.grads) - clipped.sum(0)) <= tol
    assert np.linalg.norm(flat(got.grads) - flat(want.grads)) <= 2 * tol
    loss_tol = (_TINY_FORWARD + 8) * u * np.abs(losses).mean()
    as_argument = float(jax.jit(lora.loss_fn)(adapters, batch, base))
    as_constant = float(jax.jit(closed_over)(adapters, batch))
    for value in (as_argument, as_constant):
        assert abs(value - losses.mean()) <= loss_tol
    assert lora.loss_fn(adapters, batch) == lora.loss_fn(adapters, batch, base)  # default base


@pytest.mark.slow  # ~4 s on 2 cores
def test_public_pretraining_in_chunks_gives_the_whole_batchs_mean_and_gradient():
    """Pre-training batches run in chunks of at most ``training.physical_batch_size``
    records (the largest divisor of the batch): the mean of the chunks' means is
    the batch's mean loss and gradient (float64 reference: one pass)."""
    from dpmp.app.trainer.pretrain import _chunk, _chunked_value_and_grad

    assert [_chunk(64, p) for p in (None, 100, 64, 32, 30, 7, 1)] == [64, 64, 64, 32, 16, 4, 1]
    rng = np.random.default_rng(0)
    w = {"w": rng.normal(size=(5, 3)), "b": rng.normal(size=3)}
    x, y = rng.normal(size=(12, 5)), rng.normal(size=(12, 3))

    def loss_fn(params, batch):
        out = jnp.tanh(batch["x"] @ params["w"] + params["b"])
        return ((out - batch["y"]) ** 2).sum(-1).mean()

    with jax.enable_x64(True):
        w, x, y = jax.tree.map(jnp.asarray, (w, x, y))
        assert x.dtype == jnp.float64
        want = jax.value_and_grad(loss_fn)(w, {"x": x, "y": y})
        for chunk in (12, 4, 3):
            got = jax.jit(_chunked_value_and_grad(loss_fn, chunk))(w, x, y)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12)


# ---- model.lora_targets: which modules get adapters ---------------------------------


def _decoder_like():
    """The weight names of a decoder layer (flax-style ``kernel`` leaves), a norm and
    an embedding."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    layer = {
        "self_attn": {n: {"kernel": w(8, 8)} for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "mlp": {n: {"kernel": w(8, 12)} for n in ("gate_proj", "up_proj")}
        | {"down_proj": {"kernel": w(12, 8)}},
        "input_layernorm": {"scale": w(8)},
    }
    return {"layers": {"0": layer, "1": layer}, "embed_tokens": {"embedding": w(16, 8)}}


def test_targets_adapt_the_modules_whose_path_ends_with_them():
    from dpmp.models._lora import init_adapters, merge

    base = _decoder_like()
    every = set(adapted(base))
    assert len(every) == 14  # seven projections in each of two layers, no norm, no embedding
    only = set(adapted(base, ("q_proj", "v_proj")))
    assert only == {f"layers/{i}/self_attn/{n}/kernel" for i in "01" for n in ("q_proj", "v_proj")}
    # a longer end names the same modules; a path that is not an end names none
    assert set(adapted(base, ("self_attn.q_proj", "self_attn/v_proj"))) == only
    assert set(adapted(base, ("mlp",))) == set()
    adapters = init_adapters(base, 2, jax.random.key(0), ("q_proj", "v_proj"))
    assert set(adapters) == only
    adapters = jax.tree.map(lambda a: a + 1.0, adapters)  # B is zero at the start
    merged = merge(base, adapters, 4.0, targets=("q_proj", "v_proj"))
    for (path, w), (_, m) in zip(
        jax.tree_util.tree_flatten_with_path(base)[0],
        jax.tree_util.tree_flatten_with_path(merged)[0],
        strict=True,
    ):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name in only:  # W + alpha / r * A B, in float64
            a, b = (np.asarray(adapters[name][x], np.float64) for x in "ab")
            want = np.asarray(w, np.float64) + 4.0 / 2 * a @ b
            np.testing.assert_allclose(np.asarray(m), want, rtol=1e-6, atol=1e-6)
        else:  # bit for bit
            assert np.array_equal(np.asarray(m), np.asarray(w)), name
    with pytest.raises(ValueError, match="adapters do not match"):
        merge(base, adapters, 4.0)  # made with targets, merged as if without


def test_a_target_that_names_no_weight_is_refused_with_the_modules_there_are():
    from dpmp.models._lora import init_adapters

    with pytest.raises(ValueError, match=r"'qkv' names no weight matrix .* q_proj"):
        init_adapters(_decoder_like(), 2, jax.random.key(0), ("q_proj", "qkv"))


@pytest.mark.parametrize(
    "targets, message",
    [("q_proj", "must be a list"), ([""], "is not a module name"), ([3], "is not a module")],
)
def test_lora_targets_in_a_config_are_checked(targets, message):
    with pytest.raises(ConfigError, match=f"model.lora_targets: .*{message}"):
        load_config(None, ["model.lora_rank=2", f"model.lora_targets={json.dumps(targets)}"])
    with pytest.raises(ConfigError, match="set model.lora_rank too"):
        load_config(None, ['model.lora_targets=["q_proj"]'])
    assert load_config(
        None, ["model.lora_rank=2", 'model.lora_targets=["a", "b.c"]']
    ).model.lora_targets == ("a", "b.c")
