"""The data-parallel mesh (``training.devices``) and multi-process runs.

A step on 4 (forced CPU) devices is checked against the same step on 1 device
(same keys, same batches, and noise drawn for the 4-device sum's sensitivity):
every device clips its own examples, the clipped sums meet in one all-reduce
in the accumulate dtype and the noise is added once, so only the order of the
float32 sum differs. The multi-process tests
start 2 processes on localhost (``jax.distributed`` over gloo).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpmp.app.config import ConfigError, load_config
from tests._devices import ROOT, run_on_host_devices

_STEPS_MATCH = """
import json
import jax, jax.numpy as jnp, numpy as np
from dpmp.app.config import load_config
from dpmp.clipping._private_grad import PrivateGradFn
from dpmp.app.trainer.step import audit_step, build_private_step
from dpmp.app.trainer.mesh import local

assert jax.device_count() == 4, jax.devices()
BASE = ["model.hidden=[32]", "training.expected_batch_size=96", "privacy.reproducible_noise=true",
        "training.steps=20"]


def run(devices, *extra, steps=3, noise_for=None):
    config = load_config(None, BASE + [f"training.devices={devices}", *extra])
    # noise_for: the sensitivity to draw the noise for. The 4-device sum's (4 float32
    # partial sums of a batch padded to a multiple of 4) on 1 device too: the same
    # noise, so that only the order of the sum differs.
    bound = PrivateGradFn.sensitivity_bound
    if noise_for is not None:
        PrivateGradFn.sensitivity_bound = lambda self, **kw: dict(noise_for)
    try:
        step = build_private_step(config)
    finally:
        PrivateGradFn.sensitivity_bound = bound
    s = dict(step.init_state)
    stats = []
    for t in range(steps):
        batch, pad = step.batch(step.sampler.batch(t))
        s["params"], s["opt_state"], s["loss_scale"], st = step.step_fn(
            s["params"], batch, pad, s["opt_state"], s["loss_scale"])
        st = local(st)
        stats.append([int(st.num_examples), int(st.num_clipped), int(st.num_nonfinite),
                      float(st.norm_max), float(st.noised_overflow_count)])
    params = [np.asarray(x, np.float64) for x in jax.tree.leaves(local(s["params"]))]
    return step, params, stats, float(local(s["loss_scale"]).loss_scale)


out = {}
cases = {
    "ghost": [],
    "vmap": ['privacy.clip_method="vmap"'],
    "chunks": ["training.physical_batch_size=48"],
    "fsdp": ["training.shard_params=true", "model.hidden=[64]"],
    "fp16": ['policy="fp16"', 'loss_scale.kind="private_dynamic"', "loss_scale.initial=16777216.0",
             "loss_scale.period=1", "loss_scale.count_noise_stddev=8.0"],
}
for name, extra in cases.items():
    if name not in CASES:
        continue
    four, p4, s4, scale4 = run(4, *extra)
    one, p1, s1, scale1 = run(
        1, *[e for e in extra if "shard_params" not in e], noise_for=four.fn.sensitivity
    )
    out[name] = {
        "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(p1, p4)),
        "max_param": max(float(np.abs(a).max()) for a in p1),
        "stats_1": s1, "stats_4": s4, "scale_1": scale1, "scale_4": scale4,
        "sigma_1": one.plan.noise_multiplier, "sigma_4": four.plan.noise_multiplier,
        "method_4": four.clipping["method"], "mesh_4": four.fn.mesh.size,
        "padded_4": four.sampler.padded_batch_size,
        "sensitivity_4": four.fn.sensitivity,
        # bytes of parameters and optimizer state each device holds, against the whole
        "state_share": sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(four.init_state)
            if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        ) / sum(
            x.nbytes for x in jax.tree.leaves(four.init_state)
            if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        ),
    }
    if name == "ghost":
        config = load_config(None, BASE + ["training.devices=4"])  # the ghost case's
        out["audit"] = audit_step(config, step=four).to_dict()
if "ghost" not in CASES:
    print("JSON" + json.dumps(out))
    raise SystemExit

# the same step with the clipped sums all-reduced in bfloat16: the audit flags it
from dpmp.step._step import _whole_step
from dpmp.audit._precision import audit_precision
step = run(4, steps=0)[0]
def half_sums(*args, **kwargs):
    got = step.fn.grad_fn(*args, **kwargs)
    return got._replace(grads=jax.tree.map(lambda g: g.astype(jnp.bfloat16), got.grads))
bad = _whole_step(step.fn.mesh.summed(half_sums), step.fn.optimizer)
out["bf16_psum"] = audit_precision(bad, *step.example_args, policy=step.fn.grad_fn.policy,
                                   params_argnums=0, batch_argnums=1).to_dict()
print("JSON" + json.dumps(out))
"""


def _steps_match(tmp_path, cases: tuple[str, ...]) -> dict:
    """Runs ``cases`` on 1 and on 4 devices and checks that they agree: the
    parameters within float32 rounding, the same counts, sigma and loss scale."""
    source = f"CASES = {cases!r}\n" + _STEPS_MATCH
    got = run_on_host_devices(tmp_path, "mesh_steps.py", source, timeout=300)
    for name in cases:
        case = got[name]
        assert case["mesh_4"] == 4 and case["padded_4"] % 4 == 0, case
        assert case["max_diff"] <= 1e-5 * case["max_param"], (name, case)
        assert case["sigma_1"] == case["sigma_4"]
        for a, b in zip(case["stats_1"], case["stats_4"]):
            assert a[:3] == b[:3], (name, case)  # examples, clipped, overflowed
            assert a[3] == pytest.approx(b[3], rel=1e-5)  # the largest norm
        assert case["scale_1"] == case["scale_4"]
        assert case["method_4"] == {"vmap": "vmap"}.get(name, "ghost")
        # the 4 devices' float32 sums are partial sums of the noised one
        chunks = case["padded_4"] // 48 if name == "chunks" else 1
        bound = case["sensitivity_4"]
        assert (bound["batch_size"], bound["parts"]) == (case["padded_4"], 4 * chunks), bound
    return got


@pytest.mark.slow
def test_four_devices_train_as_one_with_vmap_chunks_and_fp16(tmp_path):
    """Per-example (vmap) clipping, physical chunks split over the devices, and an
    fp16 private dynamic loss scale whose decision reads the global overflow count."""
    got = _steps_match(tmp_path, ("vmap", "chunks", "fp16"))
    assert any(s[2] > 0 for s in got["fp16"]["stats_1"]), got["fp16"]
    assert got["fp16"]["scale_4"] < 2**24, got["fp16"]  # backed off, the same on 1 device


@pytest.mark.slow  # a 4-device subprocess, ~35 s; the default suite keeps the mesh's noise draw
def test_four_devices_train_as_one(tmp_path):
    """Ghost clipping on 4 devices trains as on 1, with the state replicated and
    sharded (FSDP: each device then holds about a quarter of it); the audit of the
    4-device step reads float32 all-reduces and flags the same step with bfloat16
    ones."""
    got = _steps_match(tmp_path, ("ghost", "fsdp"))
    assert got["ghost"]["state_share"] == 1.0
    assert 0.25 <= got["fsdp"]["state_share"] < 0.3, got["fsdp"]  # the 10 biases stay whole
    audit = got["audit"]
    reduces = [f for f in audit["findings"] if f["kind"] == "all_reduce"]
    assert audit["ok"] and reduces, audit
    assert all(f["ok"] and f["out_dtype"] == "f32" for f in reduces)
    bad = got["bf16_psum"]
    flagged = [f for f in bad["findings"] if f["kind"] == "all_reduce" and not f["ok"]]
    assert not bad["ok"] and flagged and all(f["out_dtype"] == "bf16" for f in flagged)


_NOISE_DRAW = """
import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import dpmp
from dpmp.noise import _snapped as noise

assert jax.device_count() == 4
# pieces of one size, so that loop trip counts show the coordinates
noise.SNAP_CHUNK = 4096
mesh = Mesh(np.array(jax.devices()), ("data",))
tree = {
    "w": jnp.linspace(-1, 1, 1_000_003, dtype=jnp.float32),  # does not split into 4
    "k": jnp.ones((256, 4096), jnp.float32),
    "b": jnp.zeros(3, jnp.float32),  # fewer coordinates than devices
    "m": jnp.arange(64 * 12, dtype=jnp.float32).reshape(64, 12),
}
specs = {"w": P(), "k": P(None, "data"), "b": P(), "m": P("data", None)}
key = jax.random.key(9)
one = jax.jit(lambda k, t: noise._snap_tree(k, t, 0.8))(key, tree)  # one device's draw
out = {}
for name, sp in (("replicated", None), ("sharded", specs)):
    layout = sp or jax.tree.map(lambda _: P(), tree)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, layout)
    priv = dpmp.gaussian_privatizer(
        stddev=0.8, prng_key=key, policy="fp32", sharding=dpmp.NoiseSharding(mesh, "data", sp)
    )
    state = priv.init(tree)
    step = jax.jit(priv.update)
    got, _ = step(placed, state)
    ref = jax.jit(lambda k, t: noise._snap_tree(jax.random.split(k)[1], t, 0.8))(key, tree)
    out[name] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
    )
    text = step.lower(placed, state).compile().as_text()
    # the loops over pieces (the Threefry rounds' own loops run 5 times)
    out[name + "_trips"] = sorted(
        int(n) for n in re.findall(r'known_trip_count":\\{"n":"(\\d+)"', text) if n != "5"
    )
print("JSON" + __import__("json").dumps(out))
"""


@pytest.mark.slow  # a 4-device subprocess, ~11 s
def test_each_device_draws_only_its_part_of_the_noise(tmp_path):
    """On 4 devices, replicated leaves (one that does not split into 4, one smaller
    than 4) and sharded ones (FSDP, along either axis): the noisy sum equals the
    draw on one device, and each device's loops run over a quarter of the
    coordinates (in pieces of 4,096: 250,000 -> 61 pieces, 256 x 1,024 -> 64), not
    over all of them (244 and 256 pieces)."""
    got = run_on_host_devices(tmp_path, "noise_draw.py", _NOISE_DRAW, timeout=300)
    for name in ("replicated", "sharded"):
        assert got[name] is True, got
        assert got[name + "_trips"] == [61, 64], got


_GROUPED_DRAW = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import dpmp
from dpmp.noise import _snapped as noise

assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()), ("data",))
ramp = jnp.linspace(-3.0, 3.0, 64 * 256, dtype=jnp.float32)
tree = {
    "a": ramp[: 96 * 8].reshape(96, 8),  # LoRA-like adapters
    "b": ramp[: 8 * 96].reshape(8, 96)[::-1],
    "c": ramp[:3],  # fewer coordinates than devices
    "d": ramp[:700].astype(jnp.bfloat16).reshape(7, 100),
    "e": ramp[:5].astype(jnp.bfloat16),
    "s": ramp.reshape(64, 256),  # small, but split over the mesh
}
specs = {"a": P(), "b": P(None, None), "c": P(), "d": P(), "e": P(), "s": P(None, "data")}
placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
sharding = dpmp.NoiseSharding(mesh, "data", specs)
key = jax.random.key(3)
draw = jax.jit(lambda k, t: noise._snap_tree(k, t, 0.8, sharding))
got = draw(key, placed)
own = jax.jit(lambda k, t: [  # each leaf's own draw on one device
    noise.snapped_leaf(noise._key_words(jax.random.fold_in(k, i)), leaf, 0.8)
    for i, leaf in enumerate(jax.tree.leaves(t))
])(key, tree)
text = draw.lower(key, placed).as_text()
print("JSON" + json.dumps({
    "equal": [bool(np.array_equal(np.asarray(a), np.asarray(b)))
              for a, b in zip(jax.tree.leaves(got), own, strict=True)],
    "dtypes": [str(a.dtype) for a in jax.tree.leaves(got)],
    "sharded": list(got["s"].sharding.spec),
    "samples": len(re.findall(r"call @snapped_normal_sample", text)),
}))
"""


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_small_replicated_leaves_are_drawn_together_on_a_mesh(tmp_path):
    """On 4 devices, the small replicated leaves of each dtype (float32 and bfloat16)
    are drawn as one vector over the mesh and a small leaf split over the mesh
    keeps its per-device draw: 3 draws in the program (7 leaf by leaf), and every
    coordinate gets its own leaf's noise as drawn on one device."""
    got = run_on_host_devices(tmp_path, "grouped_draw.py", _GROUPED_DRAW, timeout=300)
    assert got["equal"] == [True] * 6, got
    assert got["dtypes"] == ["float32", "float32", "float32", "bfloat16", "bfloat16", "float32"]
    assert got["sharded"] == [None, "data"], got
    assert got["samples"] == 3, got


_LORA_STEPS_MATCH = """
import json, math, os
import jax, jax.numpy as jnp, numpy as np
import dpmp
from dpmp.app.config import load_config
from dpmp.app.inputs import load_data, model_from_config
from dpmp.app.trainer.mesh import local
from dpmp.app.trainer.step import build_private_step
from dpmp.clipping._private_grad import PrivateGradFn

assert jax.device_count() == 4, jax.devices()
with open(os.path.join(TMP, "private.txt"), "w") as f:
    f.write("\\n".join(f"record {i}: {'ab' * (i % 7)} {i * 37 % 101}" for i in range(200)))
BASE = ["data.dataset=text", f"data.path={json.dumps(os.path.join(TMP, 'private.txt'))}",
        "data.seq_len=12", "model.kind=lm", "model.dim=16", "model.depth=1", "model.heads=2",
        "model.lora_rank=2", "privacy.noise_multiplier=2.0", "privacy.reproducible_noise=true",
        "training.steps=3", "training.expected_batch_size=48"]
config = load_config(None, BASE)
data = load_data(config.data, 0)
base = jax.jit(model_from_config(config.model, data, config.precision).init)(jax.random.key(3))


def build(devices, method, noise_for=None):
    config = load_config(None, BASE + [f"training.devices={devices}",
                                       f"privacy.clip_method={json.dumps(method)}"])
    # noise_for: the 4-device sum's sensitivity, so that 1 device draws the same noise
    bound = PrivateGradFn.sensitivity_bound
    if noise_for is not None:
        PrivateGradFn.sensitivity_bound = lambda self, **kw: dict(noise_for)
    try:
        return build_private_step(config, data, init_params=base)
    finally:
        PrivateGradFn.sensitivity_bound = bound


out = {}
for method in ("auto", "vmap"):
    four = build(4, method)
    one = build(1, method, noise_for=four.fn.sensitivity)
    # one batch's clipped sum at adapters whose B is not zero (every adapter has a
    # gradient), the 4 devices' batch read whole on 1 device
    keys = iter(jax.random.split(jax.random.key(5), 64))
    adapters = {name: {"a": np.asarray(ab["a"]),
                       "b": np.asarray(0.3 * jax.random.normal(next(keys), ab["b"].shape))}
                for name, ab in local(four.init_state["params"]).items()}
    batch4, pad4 = four.batch(four.sampler.batch(0))
    batch1, pad1 = local((batch4, pad4))
    mesh = four.fn.mesh
    g4, st4 = jax.jit(mesh.summed(four.fn.grad_fn, frozen=1))(
        mesh.put(adapters), batch4, pad4, dpmp.NoOpLossScale(), mesh.put(base))
    method_4 = four.fn.grad_fn.resolved_method  # what the mesh's own trace took
    # the base an argument, as in the step (a constant may be folded into other roundings)
    g1 = jax.jit(lambda p, b, pad, f: one.fn.grad_fn(p, b, f, is_padding_example=pad))(
        adapters, batch1, pad1, base)
    st4 = local(st4)
    diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree.leaves(local(g4)), jax.tree.leaves(g1.grads), strict=True)]
    case = {
        "sum_diff": float(math.sqrt(sum(float((d ** 2).sum()) for d in diff))),
        "sum_norm": float(math.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum())
                                        for g in jax.tree.leaves(g1.grads)))),
        "kept": [int(st4.num_examples), int(g1.stats.num_examples)],
        "clipped": [int(st4.num_clipped), int(g1.stats.num_clipped)],
        "norm_max": [float(st4.norm_max), float(g1.stats.norm_max)],
        "padded": len(pad1), "tokens": int(batch1["x"].shape[1]),
        "methods": [method_4, one.fn.grad_fn.resolved_method, four.clipping["method"]],
        "sensitivity_4": four.fn.sensitivity,
        "sigma": [four.plan.noise_multiplier, one.plan.noise_multiplier],
    }
    out[method] = case
    if method == "vmap":
        continue
    # three private steps of the trainer's compiled step, the same noise on both
    trained = {}
    for n, step in (("4", four), ("1", one)):
        s, stats = dict(step.init_state), []
        for t in range(3):
            b, p = step.batch(step.sampler.batch(t))
            s["params"], s["opt_state"], s["loss_scale"], st = step.step_fn(
                s["params"], b, p, s["opt_state"], s["loss_scale"])
            st = local(st)
            stats.append([int(st.num_examples), int(st.num_clipped), float(st.norm_max)])
        trained[n] = [np.asarray(x, np.float64) for x in jax.tree.leaves(local(s["params"]))]
        case["stats_" + n] = stats
    case["max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(trained["4"], trained["1"]))
    case["max_param"] = max(float(np.abs(a).max()) for a in trained["1"])
    case["moved"] = max(float(np.abs(a - np.asarray(b, np.float64)).max()) for a, b in zip(
        trained["1"], jax.tree.leaves(local(one.init_state["params"]))))
print("JSON" + json.dumps(out))
"""


def _gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative error bound of a sum of
    ``k + 1`` terms in a precision of unit roundoff ``u``."""
    return k * u / (1 - k * u)


@pytest.mark.slow  # a 4-device subprocess, 6 programs: ~105 s of CPU, ~3 min on a loaded machine
def test_private_lora_on_four_devices_trains_as_on_one(tmp_path):
    """LoRA over a frozen base (an argument of the step, replicated on every
    device) with ghost clipping (``auto`` takes it, on the mesh too) and with
    per-example gradients (vmap).

    One batch's clipped sum: on 1 device the float64 sum of the clipped
    contributions rounded once to float32; on 4 each device's float64 sum rounded
    to float32, then the 4 added in float32 in XLA's order. With ``k`` kept
    examples of norm at most ``B = C (1 + 16 u)`` the contributions' norms add up
    to at most ``k B``, so the two sums differ in L2 by at most
    ``(u + gamma_3 (1 + u)) k B + u k B`` (float32 ``u = 2^-24``), plus the float64
    sums' own error, ``gamma_(n (T + 1))`` of ``u64`` per sum. Then, with ghost
    clipping, three steps of the trainer's compiled step with the noise for the
    4-device sum's sensitivity on both: the same counts, and the adapters within
    float32 rounding of the largest parameter, as for the full models above."""
    source = f"TMP = {str(tmp_path)!r}\n" + _LORA_STEPS_MATCH
    got = run_on_host_devices(tmp_path, "lora_mesh.py", source, timeout=600)
    u, u64 = 2.0**-24, 2.0**-53
    for method, case in got.items():
        ghost = method == "auto"
        assert case["methods"] == ["ghost" if ghost else "vmap"] * 3, (method, case)
        assert case["sigma"][0] == case["sigma"][1]
        bound = case["sensitivity_4"]
        assert (bound["batch_size"], bound["parts"]) == (case["padded"], 4), bound
        k, clip = case["kept"][1], bound["clip_norm"]
        assert case["kept"][0] == k and case["clipped"][0] == case["clipped"][1] > 0, case
        assert case["norm_max"][0] == pytest.approx(case["norm_max"][1], rel=1e-5)
        b = clip * (1 + 16 * u)
        f64 = 2 * _gamma(case["padded"] * (case["tokens"] + 1), u64) * bound["cancellation"]
        tol = (2 * u + _gamma(3, u) * (1 + u) + f64) * k * b
        assert case["sum_diff"] <= tol, (method, case["sum_diff"], tol)
        assert case["sum_norm"] > 100 * tol  # the sums are not (near) zero
        if not ghost:
            continue
        assert case["stats_4"] == [
            s[:2] + [pytest.approx(s[2], rel=1e-5)] for s in case["stats_1"]
        ], case
        assert case["moved"] > 10 * case["max_diff"], case  # the adapters moved
        assert case["max_diff"] <= 1e-5 * case["max_param"], (method, case)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "must be finite and > 0"),
        (-2, "must be finite and > 0"),
        (10**11, "at most"),
        ("two", 'a number of devices or "all"'),
        (1.5, "must be an integer"),
    ],
)
def test_training_devices_is_checked(value, words):
    text = json.dumps(value) if isinstance(value, str) else str(value)
    with pytest.raises(ConfigError, match="training.devices") as e:
        load_config(None, [f"training.devices={text}"])
    assert words in str(e.value)


def test_more_devices_than_jax_sees_is_one_line():
    import jax

    from dpmp.app.trainer.mesh import make_mesh

    config = load_config(None, [f"training.devices={jax.device_count() + 1}"])
    with pytest.raises(ConfigError, match=r"training.devices: \d+, but JAX sees") as e:
        make_mesh(config)
    assert "xla_force_host_platform_device_count" in str(e.value)
    assert make_mesh(load_config(None, ['training.devices="all"'])) is None  # one CPU device


def test_a_batch_that_does_not_split_over_the_devices_is_refused():
    from dpmp.app.trainer.batches import make_sampler

    config = load_config(None, ["training.physical_batch_size=50", "training.devices=4"])
    with pytest.raises(ConfigError, match="physical_batch_size: 50 does not split over"):
        make_sampler(config, 1000, 0, devices=4)
    config = load_config(None, ["training.expected_batch_size=50"])
    assert make_sampler(config, 1000, 0, devices=4).padded_batch_size % 4 == 0


# ---- several processes ----------------------------------------------------------

_FREE_PORT = """
import socket
s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1]); s.close()
"""


def _port() -> int:
    return int(subprocess.check_output([sys.executable, "-c", _FREE_PORT], text=True))


def _env(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


_SETTINGS = [
    "--set", "privacy.reproducible_noise=true",
    "--set", "training.steps=24",
    "--set", "training.checkpoint_every=4",
    "--set", "training.eval_every=0",
]  # fmt: skip


def _dpmp(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dpmp.cli", "train", "--out", str(out), "--quiet",
            *_SETTINGS, *args]  # fmt: skip


def _processes(out: Path, port: int, *args: str) -> list[subprocess.Popen]:
    """2 processes of one run on localhost, 1 CPU device each."""
    joined = ["--set", 'training.devices="all"', "--coordinator", f"localhost:{port}"]
    return [
        subprocess.Popen(
            _dpmp(out, *joined, "--num-processes", "2", "--process-id", str(i), *args),
            env=_env(1),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


FSDP = ("--set", "training.shard_params=true")


def _params(out: Path) -> list[np.ndarray]:
    newest = sorted((out / "checkpoints").glob("checkpoint_*.npz"))[-1]
    with np.load(newest) as f:
        return [f[k].astype(np.float64) for k in sorted(f) if f[k].dtype.kind == "f"]


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_together(tmp_path):
    """2 processes on localhost (1 CPU device each) train the default config as one
    process on 2 devices does: the same parameters within float32 rounding, the
    same epsilon; so do they with the state sharded over them (gathered for the
    checkpoints). Killed both (SIGKILL) after a checkpoint and started again, they
    resume together and end where an uninterrupted run ends."""
    single = tmp_path / "single"
    run = subprocess.run(
        _dpmp(single, "--set", "training.devices=2"), env=_env(2), cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr

    together = tmp_path / "together"
    procs = _processes(together, _port())
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "process 1 of 2: done" in outs[1]
    a = json.loads((single / "report.json").read_text())
    b = json.loads((together / "report.json").read_text())
    assert b["mesh"] == {**a["mesh"], "processes": 2}
    assert a["epsilon"] == b["epsilon"] and a["noise_multiplier"] == b["noise_multiplier"]
    scale = max(np.abs(x).max() for x in _params(single))
    diff = max(np.abs(x - y).max() for x, y in zip(_params(single), _params(together)))
    assert diff <= 1e-5 * scale, diff

    # the same with the parameters and optimizer state sharded over the 2 processes
    sharded = tmp_path / "sharded"
    procs = _processes(sharded, _port(), *FSDP)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    diff = max(np.abs(x - y).max() for x, y in zip(_params(single), _params(sharded)))
    assert diff <= 1e-5 * scale, diff
    assert json.loads((sharded / "report.json").read_text())["mesh"]["sharded_params"] is True

    # sharded, killed both after a checkpoint, then started again: they resume together
    killed = tmp_path / "killed"
    procs = _processes(killed, _port(), *FSDP)
    deadline = time.monotonic() + 240
    while not list((killed / "checkpoints").glob("checkpoint_00000008.npz")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert not (killed / "report.json").exists()  # killed part-way
    procs = _processes(killed, _port(), *FSDP)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    log = (killed / "train.log").read_text()
    assert "resumed from checkpoint_" in log
    resumed = json.loads((killed / "report.json").read_text())
    assert resumed["epsilon"] == b["epsilon"] and resumed["steps"] == 24
    diff = max(np.abs(x - y).max() for x, y in zip(_params(together), _params(killed)))
    assert diff <= 1e-5 * scale, diff


@pytest.mark.slow  # ~6 s on 2 cores
def test_joining_without_a_coordinator_is_one_line(tmp_path):
    """``--distributed`` outside any cluster, and a process index past the count, are
    one-line usage errors naming the flags."""
    run = subprocess.run(
        [sys.executable, "-m", "dpmp.cli", "train", "--distributed", "--out", str(tmp_path)],
        env=_env(1), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--coordinator, --num-processes and --process-id" in lines[0]

    from dpmp import cli

    args = ["train", "--num-processes", "2", "--process-id", "2", "--out", str(tmp_path)]
    assert cli.main(args) == 2


_SHARED_KEYS = """
import json, sys
from dpmp.app.trainer.mesh import initialize
initialize(f"localhost:{sys.argv[1]}", 2, int(sys.argv[2]))
import jax, numpy as np
from dpmp.app.config import load_config
from dpmp.app.trainer.mesh import shared_keys
from dpmp.app.trainer.plan import run_keys

own = run_keys(load_config(None))  # fresh OS entropy, different in each process
got = shared_keys(own)
data = lambda k: np.asarray(jax.random.key_data(k)).tolist()
row = lambda k: [data(k.noise), data(k.loss_scale), str(k.sampler_seed), str(k.standardize_seed)]
print("JSON" + json.dumps({"own": row(own), "got": row(got)}))
"""


@pytest.mark.slow  # ~9 s on 2 cores
def test_every_process_uses_process_0s_secret_keys(tmp_path):
    """Each process draws its own keys from the OS; the run uses process 0's,
    handed to every process (the noise and the batches must be the same on all)."""
    script = tmp_path / "keys.py"
    script.write_text(_SHARED_KEYS)
    port = str(_port())
    procs = [
        subprocess.Popen([sys.executable, str(script), port, str(i)], env=_env(1), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    first, second = (json.loads(out.split("JSON", 1)[1]) for out, _ in outs)
    assert first["own"] != second["own"]  # fresh entropy in each process
    assert first["got"] == first["own"] == second["got"]
    assert int(first["got"][2]) >= 2**64  # 128-bit seeds survive the trip whole


@pytest.mark.slow  # ~9 s on 2 cores
def test_processes_with_different_configs_refuse_to_train(tmp_path):
    """Two processes given different configs (here, steps) both stop with one line
    before any step, rather than train on different plans."""
    port = _port()
    joined = ["--set", 'training.devices="all"', "--coordinator", f"localhost:{port}"]
    procs = [
        subprocess.Popen(
            _dpmp(tmp_path / "run", *joined, "--num-processes", "2", "--process-id", str(i),
                  "--set", f"training.steps={24 + i}"),
            env=_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err
        assert "dpmp train: error: processes disagree on the config" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
