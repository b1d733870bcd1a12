import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp import Policy, PrecisionError

ROLES = ("param", "compute", "output", "grad", "clip", "accumulate", "noise")


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16"])
def test_presets_round_trip(preset):
    p = Policy.parse(preset)
    assert Policy.parse(str(p)) == p
    assert p.clip == p.accumulate == p.noise == np.dtype("float32")
    assert p.param == np.dtype("float32")


def test_presets_dtypes():
    assert Policy.parse("bf16").compute == jnp.bfloat16
    assert Policy.parse("bf16").grad == jnp.bfloat16
    assert Policy.parse("fp16").compute == jnp.float16
    assert all(getattr(Policy.fp32(), r) == jnp.float32 for r in ROLES)


@pytest.mark.parametrize(
    "param,compute,output,grad",
    list(
        itertools.product(["f32", "bf16"], ["f32", "bf16", "f16"], ["f32", "f16"], ["bf16", "f32"])
    ),
)
def test_round_trip_all_combinations(param, compute, output, grad):
    p = Policy.parse(f"param={param},compute={compute},output={output},grad={grad}")
    assert Policy.parse(str(p)) == p
    assert str(Policy.parse(str(p))) == str(p)


@pytest.mark.parametrize(
    "long,short",
    [("bfloat16", "bf16"), ("float16", "f16"), ("float32", "f32"), ("float64", "f64")],
)
def test_long_and_short_names(long, short):
    assert Policy.parse(f"compute={long}") == Policy.parse(f"compute={short}")
    assert Policy.parse(f"c={short}").compute == np.dtype(long)
    assert Policy(compute=long).compute == np.dtype(long)
    assert Policy(compute=getattr(jnp, long)).compute == np.dtype(long)


def test_preset_with_overrides_and_aliases():
    p = Policy.parse("bf16, output=bf16, acc=float64, p=f32")
    assert p.output == jnp.bfloat16 and p.accumulate == jnp.float64 and p.grad == jnp.bfloat16


@pytest.mark.parametrize("spec", ["compute=bfloat", "compute=int8", "noise=float8", "grad=tf32"])
def test_unknown_dtype_names_allowed(spec):
    with pytest.raises(ValueError, match="allowed") as e:
        Policy.parse(spec)
    assert "bfloat16" in str(e.value) and "float32" in str(e.value)


def test_unknown_key_names_allowed():
    with pytest.raises(ValueError, match="unknown key 'comptue'") as e:
        Policy.parse("comptue=bf16")
    for role in ROLES:
        assert role in str(e.value)


def test_bad_preset_and_syntax():
    with pytest.raises(ValueError, match="allowed presets"):
        Policy.parse("bfloat")
    with pytest.raises(ValueError, match="not key=value"):
        Policy.parse("compute=bf16,bf16")
    with pytest.raises(ValueError, match="empty"):
        Policy.parse("")
    with pytest.raises(ValueError, match="not a floating dtype"):
        Policy(compute=jnp.int32)


@pytest.mark.parametrize("role", ["clip", "accumulate", "noise"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_privacy_roles_below_f32_raise(role, dtype):
    with pytest.raises(PrecisionError, match=role):
        Policy.parse(f"{role}={dtype}")
    with pytest.raises(PrecisionError):
        Policy(**{role: dtype})
    # PrecisionError is a ValueError, so generic handlers still catch it.
    assert issubclass(PrecisionError, ValueError)


def test_unsafe_opt_in_round_trips():
    p = Policy.parse("bf16,noise=bf16,unsafe=true")
    assert p.noise == jnp.bfloat16 and p.allow_unsafe
    assert Policy.parse(str(p)) == p
    assert Policy(accumulate="bf16", allow_unsafe=True).accumulate == jnp.bfloat16
    with pytest.raises(ValueError, match="unsafe"):
        Policy.parse("unsafe=maybe")


def test_policy_is_frozen_and_hashable():
    p = Policy.parse("bf16")
    with pytest.raises(AttributeError):
        p.compute = jnp.float32
    assert hash(p) == hash(Policy.parse(str(p)))
    assert p.replace(output="bf16").output == jnp.bfloat16
    with pytest.raises(PrecisionError):
        p.replace(noise="bf16")


def test_cast_methods():
    p = Policy.parse("param=f32,compute=bf16,output=f16,grad=bf16")
    tree = {"w": jnp.ones((2,), jnp.float32), "n": jnp.arange(3)}
    assert p.cast_to_compute(tree)["w"].dtype == jnp.bfloat16
    assert p.cast_to_output(tree)["w"].dtype == jnp.float16
    assert p.cast_to_param(p.cast_to_compute(tree))["w"].dtype == jnp.float32
    assert p.cast_to_compute(tree)["n"].dtype == tree["n"].dtype
    assert dpmp.Policy.parse("bf16").is_half and not dpmp.Policy.fp32().is_half
