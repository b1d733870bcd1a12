"""The private step: built from objects (``dpmp.private_step``), and the
trainer's, over physical chunks of a logical batch.

A step built from a model's loss, a policy, a clip norm, the noise and an optax
optimizer, with no config, is the trainer's step bit for bit (one device, and
4 forced CPU devices). A Poisson batch of expected size 1024 processed in chunks of 128 gives the
clipped sum of the one-shot step on the same sample (fp32, 1e-5), draws the
noise once (the chunked step's update equals the one-shot step's under the
same key), adjusts a private loss scale once, and compiles to at most a
quarter of the one-shot step's temporary memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import audit_step, build_private_step, run_keys
from dpmp.app.trainer.step import _make_optimizer
from dpmp.clipping._private_grad import PrivateGradStats, combine_stats
from dpmp.noise._noise import private_optimizer
from dpmp.step import physical_chunks
from dpmp.step._step import _summed, _whole_step
from tests._devices import run_on_host_devices

LOGICAL = [
    "policy=fp32",
    "training.expected_batch_size=1024",
    "privacy.reproducible_noise=true",
    "privacy.noise_multiplier=1.0",
    # per-example gradients: their memory is what physical batches bound (ghost
    # clipping's one-shot step is already small, see tests/test_ghost.py)
    "privacy.clip_method=vmap",
]


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.fixture(scope="module")
def configs():
    """The chunked and the one-shot configs of ``steps``."""
    return (
        load_config(None, [*LOGICAL, "training.physical_batch_size=128"]),
        load_config(None, LOGICAL),
    )


@pytest.fixture(scope="module")
def steps(configs, digits):
    chunked, one_shot = configs
    keys = run_keys(chunked)
    return (
        build_private_step(chunked, digits, keys=keys),
        build_private_step(one_shot, digits, keys=keys),
    )


def _rel(a, b):
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)]).astype(np.float64)
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)]).astype(np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_chunks_sum_to_the_one_shot_clipped_sum(steps):
    chunked, one_shot = steps
    params, batch, pad = chunked.example_args[:3]
    assert chunked.sampler.padded_batch_size % 128 == 0
    # the one-shot step on the very same (padded) sample
    whole = one_shot.fn.grad_fn(params, batch, is_padding_example=pad)
    acc = jax.tree.map(jnp.zeros_like, whole.grads)
    parts = []
    for chunk, chunk_pad in physical_chunks(batch, pad, 128):
        acc, stats = chunked.fn.chunked.chunk_fn(
            params, chunk, chunk_pad, chunked.init_state["loss_scale"], acc
        )
        parts.append(stats)
    assert len(parts) == chunked.sampler.padded_batch_size // 128
    assert _rel(acc, whole.grads) < 1e-5
    total = combine_stats(parts)
    assert int(total.num_examples) == int(whole.stats.num_examples) == int((~pad).sum())
    assert int(total.num_clipped) == int(whole.stats.num_clipped)
    assert float(total.norm_max) == pytest.approx(float(whole.stats.norm_max), rel=1e-6)
    assert float(total.norm_mean) == pytest.approx(float(whole.stats.norm_mean), rel=1e-5)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_chunked_step_draws_the_noise_once(configs, steps):
    chunked, one_shot = steps
    a = chunked.step_fn(*chunked.example_args)
    # The one-shot sum with the chunked step's optimizer: its noise is drawn for the
    # chunked sum's sensitivity (8 float32 partial sums), a little above the one-shot's.
    b = _whole_step(_summed(one_shot.fn.grad_fn), chunked.fn.optimizer)(*one_shot.example_args)
    # Same key, one draw each: the same noisy update. A second draw (or a draw
    # per chunk) would move the parameters by ~sigma C / E[B] per coordinate.
    assert _rel(a[0], b[0]) < 1e-5
    # and the audit finds the same noise draws in both (one per leaf and piece)
    report = audit_step(configs[0], step=chunked)
    whole = audit_step(configs[1], step=one_shot)
    assert report.ok and report.counts()["noise_sample"] == whole.counts()["noise_sample"]


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_noise_is_drawn_for_the_sensitivity_of_the_sum_as_computed(configs, steps):
    """stddev = noise multiplier x the sensitivity of the noised sum, rounding included:
    the padded batch, and the chunks' float32 partial sums added up (8 here)."""
    chunked, one_shot = steps
    config = configs[0]
    c = config.privacy.l2_clip_norm
    for step, chunk in ((chunked, 128), (one_shot, None)):
        padded = step.sampler.padded_batch_size  # a multiple of the chunk size
        parts = 1 if chunk is None else padded // chunk
        bound = step.fn.sensitivity
        assert (bound["batch_size"], bound["parts"]) == (padded, parts)
        assert bound["sensitivity"] == step.fn.grad_fn.sensitivity(batch_size=padded, parts=parts)
        assert bound["accumulate_dtype"] == "float64"
        # 2 u n C for the rounding to float32, 2 gamma_(M-1) n C for the partial sums
        u = 2.0**-24
        low = c * (1 + 2 * padded * u + 2 * (parts - 1) * padded * u)
        assert low < bound["sensitivity"] < low * (1 + 1e-6)
    assert chunked.fn.sensitivity["sensitivity"] > one_shot.fn.sensitivity["sensitivity"]

    # the optimizer's noise is the one private_optimizer draws for that sensitivity
    params, _, _, opt_state, _ = chunked.example_args
    zeros = jax.tree.map(jnp.zeros_like, params)
    got, _ = chunked.fn.optimizer.update(zeros, opt_state, params)

    def noise_for(l2_clip_norm):
        opt = private_optimizer(
            _make_optimizer(config),
            noise_multiplier=chunked.plan.noise_multiplier,
            l2_clip_norm=l2_clip_norm,
            expected_batch_size=config.training.expected_batch_size,
            prng_key=chunked.keys.noise,
            policy=config.precision,
            sampler=config.privacy.noise_sampler,
        )
        return opt.update(zeros, opt.init(params), params)[0]

    assert _rel(got, noise_for(chunked.fn.sensitivity["sensitivity"])) == 0
    assert _rel(got, noise_for(c)) > 0


@pytest.mark.slow  # ~11 s on 2 cores
def test_chunked_step_compiles_to_a_quarter_of_the_memory(steps):
    chunked, one_shot = steps
    params, batch, pad, opt_state, scale = chunked.example_args
    chunk, chunk_pad = next(physical_chunks(batch, pad, 128))
    acc = jax.tree.map(jnp.zeros_like, params)
    small = chunked.fn.chunked.chunk_fn.lower(params, chunk, chunk_pad, scale, acc).compile()
    apply = chunked.fn.chunked.apply_fn.lower(params, acc, opt_state, scale, jnp.int32(0))
    apply = apply.compile()
    big = one_shot.step_fn.lower(*one_shot.example_args).compile()
    chunk_temp = max(
        small.memory_analysis().temp_size_in_bytes, apply.memory_analysis().temp_size_in_bytes
    )
    one_shot_temp = big.memory_analysis().temp_size_in_bytes
    assert chunk_temp <= one_shot_temp / 4, (chunk_temp, one_shot_temp)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_private_loss_scale_is_adjusted_once_from_the_whole_batch(digits):
    config = load_config(
        None,
        [
            "policy=fp16",
            "loss_scale.kind=private_dynamic",
            "loss_scale.initial=16777216.0",  # 2^24: every example overflows in fp16
            # ~512 overflows: the noised count (stddev 64) is above the 192 threshold
            # whatever the draw (5 sigma)
            "training.expected_batch_size=512",
            "training.physical_batch_size=128",
            "privacy.reproducible_noise=true",
        ],
    )
    step = build_private_step(config, digits)
    _, _, scale, stats = step.step_fn(*step.example_args)
    assert int(stats.num_nonfinite) == int(stats.num_examples) > 0
    assert np.isfinite(float(stats.noised_overflow_count))
    # backed off once (one factor of 2), not once per chunk
    assert float(scale.loss_scale) == float(step.init_state["loss_scale"].loss_scale) / 2


def test_combined_statistics_weigh_chunks_by_their_examples():
    def stats(n, bad, mean, mx, med, loss):
        f = jnp.float32
        return PrivateGradStats(
            jnp.int32(n),
            jnp.int32(bad),
            jnp.int32(0),
            f(mean),
            f(mx),
            f(med),
            f(loss),
            f(1),
            f(jnp.nan),
        )

    total = combine_stats(
        [
            stats(3, 1, 2.0, 5.0, 2.0, 1.0),
            stats(1, 0, 6.0, 6.0, 6.0, 5.0),
            stats(0, 0, 0.0, 0.0, 0.0, 0.0),
        ]
    )
    assert int(total.num_examples) == 4 and int(total.num_nonfinite) == 1
    assert float(total.norm_mean) == pytest.approx((2 * 2.0 + 1 * 6.0) / 3)
    assert float(total.loss_mean) == pytest.approx((3 * 1.0 + 5.0) / 4)
    assert float(total.norm_max) == 6.0
    assert float(total.norm_median) == 4.0  # the empty chunk's 0 is not a median


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_memory_check_reads_the_compiled_step_and_refuses_what_does_not_fit(steps):
    """``step_memory`` is the compiled step's own count (arguments, outputs and
    temporaries; with chunks, the larger call plus what stays beside it), at least
    the parameters and Adam's slots in and out; a limit below it is one line."""
    from dpmp.app.config import ConfigError
    from dpmp.app.trainer.step import check_step_memory, step_memory

    chunked, one_shot = steps
    m = one_shot.step_fn.lower(*one_shot.example_args).compile().memory_analysis()
    whole = step_memory(one_shot)
    assert whole == (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    state = sum(x.nbytes for x in jax.tree.leaves(one_shot.init_state["params"]))
    assert whole >= 6 * state  # params and two moments, in and out
    part = step_memory(chunked)
    assert 6 * state <= part < whole  # per-example gradients of 128, not 1,024
    assert check_step_memory(chunked, limit=part) == part
    with pytest.raises(ConfigError, match=r"needs .* GiB per device .* lower training.physical"):
        check_step_memory(chunked, limit=part - 1)


@pytest.mark.slow  # ~5 s on 2 cores
@pytest.mark.parametrize("target", [2.0, 30.0])
def test_a_truncated_poisson_sample_takes_a_thousandth_of_delta_at_most(digits, target):
    """The padded size is chosen for the epsilon target: its truncation bound,
    steps x p x (1 + e^epsilon), is reserved from privacy.delta and stays within
    a thousandth of it (at epsilon 30 the per-step probability is ~3e-24, where
    the old fixed 1e-12 bound would have been 1e4 times delta)."""
    from scipy import stats

    config = load_config(None, [f"privacy.target_epsilon={target}", "training.steps=300"])
    step = build_private_step(config, digits)
    s, delta = step.sampler, config.privacy.delta
    # the sampler's truncation probability, recomputed from the binomial
    p = stats.binom.sf(s.padded_batch_size, s.num_examples + 1, s.sampling_prob)
    assert p == pytest.approx(s.truncation_probability)
    assert 300 * p * (1 + np.exp(target)) <= step.plan.truncation_delta <= 1e-3 * delta
    assert step.plan.budget.delta == pytest.approx(delta - step.plan.truncation_delta)


# A small run whose mechanism the builder is given by hand below.
_SMALL = [
    "model.hidden=[32]",
    "training.expected_batch_size=128",
    "training.learning_rate=0.01",
    "privacy.noise_multiplier=2.0",
    "privacy.reproducible_noise=true",
]


def _by_hand(model, data, keys, padded, *, physical=None, mesh=None):
    """The small run's step from objects alone: the model's loss, the policy, the
    clip norm, the noise and the optimizer as numbers, no ``Config``."""
    grad_fn = dpmp.private_grad(model.loss_fn, l2_clip_norm=1.0, policy=dpmp.Policy.parse("bf16"))
    params = jax.jit(model.init)(jax.random.split(jax.random.key(0), 3)[0])
    example = {"x": np.asarray(data.x_train[:8], np.float32), "y": np.asarray(data.y_train[:8])}
    step = dpmp.private_step(
        grad_fn,
        optax.adam(0.01),
        params=params,
        batch=example,
        noise_multiplier=2.0,
        noise_key=keys.noise,
        expected_batch_size=128,
        padded_batch_size=padded,
        physical_batch_size=physical,
        mesh=mesh,
    )
    return step, step.init(params)


def _rows(data, sampled):
    rows = np.where(sampled.is_padding_example, 0, sampled.indices)
    x, y = np.asarray(data.x_train[rows], np.float32), np.asarray(data.y_train[rows], np.int32)
    return {"x": x, "y": y}, sampled.is_padding_example


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
@pytest.mark.parametrize("physical", [None, 48])
def test_a_step_built_from_objects_is_the_trainers_step(digits, physical):
    chunks = [] if physical is None else [f"training.physical_batch_size={physical}"]
    trainer = build_private_step(load_config(None, [*_SMALL, *chunks]), digits)
    padded = trainer.sampler.padded_batch_size
    step, state = _by_hand(trainer.model, digits, trainer.keys, padded, physical=physical)
    assert step.sensitivity == trainer.fn.sensitivity
    assert (step.chunked is None) == (physical is None)
    ref = dict(trainer.init_state)
    for t in range(3):
        sampled = trainer.sampler.batch(t)
        state, stats = step(state, *step.put_batch(*_rows(digits, sampled)))
        batch, pad = trainer.batch(sampled)
        ref["params"], ref["opt_state"], ref["loss_scale"], ref_stats = trainer.step_fn(
            ref["params"], batch, pad, ref["opt_state"], ref["loss_scale"]
        )
        assert int(stats.num_examples) == int(ref_stats.num_examples) > 0
        assert int(stats.num_clipped) == int(ref_stats.num_clipped)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(  # it trained
        np.asarray(jax.tree.leaves(state.params)[0]),
        np.asarray(jax.tree.leaves(trainer.init_state["params"])[0]),
    )


@pytest.mark.slow  # ~4 s on 2 cores
def test_the_builder_refuses_what_it_cannot_build(digits):
    trainer = build_private_step(load_config(None, _SMALL), digits)
    padded = trainer.sampler.padded_batch_size
    with pytest.raises(ValueError, match="physical_batch_size: 100 does not divide"):
        _by_hand(trainer.model, digits, trainer.keys, padded, physical=100)
    with pytest.raises(ValueError, match="shard_params: shards over a mesh"):
        dpmp.private_step(
            trainer.fn.grad_fn,
            optax.sgd(0.1),
            params=trainer.init_state["params"],
            batch=trainer.example_args[1],
            noise_multiplier=1.0,
            noise_key=trainer.keys.noise,
            expected_batch_size=128,
            padded_batch_size=padded,
            shard_params=True,
        )


_MESH_MATCH = """
import json, sys
import jax, numpy as np
import dpmp
import dpmp.step

# the step's layer knows no run and no config
assert not any(name.startswith("dpmp.app") for name in sys.modules), sorted(sys.modules)
from dpmp.app.inputs import load_data
from tests.test_step import _SMALL, _by_hand, _rows

assert jax.device_count() == 4
data = None
out = {}
for physical in (None, 48):
    from dpmp.app.config import Config, load_config
    from dpmp.app.trainer import build_private_step
    from dpmp.app.trainer.mesh import local

    data = data or load_data(Config().data, seed=0)
    chunks = [] if physical is None else [f"training.physical_batch_size={physical}"]
    config = load_config(None, [*_SMALL, "training.devices=4", *chunks])
    trainer = build_private_step(config, data)
    mesh = dpmp.DataParallelMesh(jax.devices()[:4])
    step, state = _by_hand(
        trainer.model, data, trainer.keys, trainer.sampler.padded_batch_size,
        physical=physical, mesh=mesh,
    )
    ref = dict(trainer.init_state)
    for t in range(2):
        sampled = trainer.sampler.batch(t)
        state, stats = step(state, *step.put_batch(*_rows(data, sampled)))
        batch, pad = trainer.batch(sampled)
        ref["params"], ref["opt_state"], ref["loss_scale"], _ = trainer.step_fn(
            ref["params"], batch, pad, ref["opt_state"], ref["loss_scale"])
    mine, theirs = local(state.params), local(ref["params"])
    out[str(physical)] = {
        "equal": all(np.array_equal(a, b) for a, b in
                     zip(jax.tree.leaves(mine), jax.tree.leaves(theirs))),
        "parts": step.sensitivity["parts"],
        "examples": int(local(stats).num_examples),
    }
print("JSON" + json.dumps(out))
"""


@pytest.mark.slow  # a 4-device subprocess compiling four steps, ~40 s
def test_a_step_built_from_objects_on_four_devices_is_the_trainers_step(tmp_path):
    """On a forced 4-device CPU mesh, whole and in physical chunks."""
    got = run_on_host_devices(tmp_path, "builder_mesh.py", _MESH_MATCH, timeout=300)
    assert got["None"]["equal"] and got["48"]["equal"], got
    assert got["None"]["parts"] == 4 and got["48"]["parts"] % 4 == 0 < got["48"]["examples"]


def _four_row_step(grad_fn, params, batch, **options):
    """``dpmp.private_step`` of ``grad_fn`` and Adam for batches of 4 rows, a known key."""
    return dpmp.private_step(
        grad_fn,
        optax.adam(1e-2),
        params=params,
        batch=batch,
        noise_multiplier=1.0,
        noise_key=jax.random.key(1),
        expected_batch_size=4,
        padded_batch_size=4,
        **options,
    )


@pytest.mark.slow  # ~4 s on 2 cores
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_every_stage_of_the_private_step_is_named_in_its_program(method):
    """A profile of the compiled step can tell its stages apart: each runs under its
    ``jax.named_scope`` (``dpmp.precision._stages``), noise inside the optimizer."""
    import re

    from dpmp.precision._stages import STAGES, stage_of

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (6, 8)), "w2": jax.random.normal(k2, (8, 1))}
    batch = {"x": jnp.ones((4, 6)), "y": jnp.zeros((4, 1))}
    grad_fn = dpmp.private_grad(loss_fn, l2_clip_norm=1.0, policy="fp32", method=method)
    step = _four_row_step(grad_fn, params, batch)
    pad = jnp.zeros((4,), bool)
    text = jax.jit(lambda s: step(s, batch, pad)[0]).lower(step.init(params)).compile().as_text()
    op_names = re.findall(r'op_name="([^"]*)"', text)
    assert {stage_of(op) for op in op_names} >= set(STAGES)
    noise = [op for op in op_names if stage_of(op) == "noise"]
    assert noise and all(STAGES["optimizer"] in op for op in noise)
    plain = jax.jit(jax.grad(loss_fn)).lower(params, batch).compile().as_text()
    assert {stage_of(op) for op in re.findall(r'op_name="([^"]*)"', plain)} == {None}


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
@pytest.mark.parametrize("physical", [None, 2])
def test_a_donating_step_is_the_same_step_written_in_place(physical):
    """``donate=True``: the step's result is the same bit for bit, the state passed in
    is deleted (its buffers hold the new state), and the compiled whole step aliases
    every byte of the parameters and the optimizer state to its outputs."""

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (6, 8)), "w2": jax.random.normal(k2, (8, 1))}
    batch = {"x": jax.random.normal(k3, (4, 6)), "y": jnp.ones((4, 1))}
    pad = jnp.array([False, False, True, False])
    grad_fn = dpmp.private_grad(loss_fn, l2_clip_norm=1.0, policy="fp32")

    kept = _four_row_step(grad_fn, params, batch, physical_batch_size=physical)
    donating = _four_row_step(grad_fn, params, batch, physical_batch_size=physical, donate=True)
    state = kept.init(params)
    reference = kept(kept(state, batch, pad)[0], batch, pad)[0]
    state = donating.init(params)
    first = state
    for _ in range(2):
        state = donating(state, batch, pad)[0]
    assert all(x.is_deleted() for x in jax.tree.leaves((first.params, first.opt_state)))

    def values(tree):
        return [
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for x in jax.tree.leaves(tree)
        ]

    for got, want in zip(values(state), values(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if physical is None:
        s = donating.init(params)
        memory = donating.step_fn.lower(s.params, batch, pad, s.opt_state, s.loss_scale)
        donated = sum(x.nbytes for x in jax.tree.leaves((s.params, s.opt_state)))
        assert memory.compile().memory_analysis().alias_size_in_bytes == donated
