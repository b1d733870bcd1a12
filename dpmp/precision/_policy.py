"""Precision policy: which dtype each stage of a (private) training step uses.

A ``Policy`` is a frozen value with seven dtype roles:

=========== ================================================================
role        what it governs
=========== ================================================================
param       storage dtype of the master parameters (and of the update)
compute     dtype of the forward and backward pass
output      dtype of the model output handed to the loss
grad        dtype of the (per-example) gradients before they are unscaled
clip        dtype of per-example norms and clip factors        (>= float32)
accumulate  dtype of the sum of clipped per-example gradients  (>= float32)
noise       dtype Gaussian noise is drawn and added in         (>= float32)
=========== ================================================================

The last three carry the privacy guarantee. Below float32 they break it
(bf16 noise takes ~128 distinct values; a bf16 sum of clipped gradients has a
sensitivity ~2x the clip norm), so they raise ``PrecisionError`` unless
the caller opts in with ``allow_unsafe=True``.

The string form is ``"param=f32,compute=bf16,output=f32,grad=bf16,clip=f32,
accumulate=f32,noise=f32"``; ``Policy.parse(str(policy)) == policy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from dpmp.precision._casting import cast_tree
from dpmp.precision._dtypes import below_float32, canonical_dtype, dtype_name

__all__ = ["Policy", "PrecisionError"]


class PrecisionError(ValueError):
    """A dtype choice that would silently break the privacy guarantee."""


_ROLES = ("param", "compute", "output", "grad", "clip", "accumulate", "noise")
_KEY_ALIASES = {
    "param": "param",
    "params": "param",
    "p": "param",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
    "grad": "grad",
    "grads": "grad",
    "g": "grad",
    "clip": "clip",
    "accumulate": "accumulate",
    "acc": "accumulate",
    "noise": "noise",
}
_PRIVACY_ROLES = ("clip", "accumulate", "noise")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """Dtypes for every stage of a training step; see the module docstring.

    Example::

      >>> import dpmp
      >>> p = dpmp.Policy.parse("bf16")
      >>> str(p)
      'param=f32,compute=bf16,output=f32,grad=bf16,clip=f32,accumulate=f32,noise=f32'
      >>> dpmp.Policy.parse(str(p)) == p
      True
    """

    param: Any = jnp.float32
    compute: Any = jnp.float32
    output: Any = jnp.float32
    grad: Any = jnp.float32
    clip: Any = jnp.float32
    accumulate: Any = jnp.float32
    noise: Any = jnp.float32
    allow_unsafe: bool = False

    def __post_init__(self):
        for role in _ROLES:
            object.__setattr__(self, role, canonical_dtype(getattr(self, role), field=role))
        if not isinstance(self.allow_unsafe, bool):
            raise ValueError(f"allow_unsafe: expected a bool, got {self.allow_unsafe!r}")
        if not self.allow_unsafe:
            for role in _PRIVACY_ROLES:
                dtype = getattr(self, role)
                if below_float32(dtype):
                    raise PrecisionError(
                        f"{role}={dtype_name(dtype)} breaks the privacy guarantee: {role} must "
                        "be float32 or float64 (pass allow_unsafe=True, or 'unsafe=true' in "
                        "the string form, to opt in knowingly)"
                    )

    # ---- presets -------------------------------------------------------------
    @classmethod
    def fp32(cls) -> Policy:
        """Everything in float32: the reference."""
        return cls()

    @classmethod
    def bf16(cls) -> Policy:
        """bf16 forward/backward and per-example gradients; fp32 master params,
        logits, norms, sum and noise."""
        return cls(compute=jnp.bfloat16, grad=jnp.bfloat16)

    @classmethod
    def fp16(cls) -> Policy:
        """fp16 forward/backward and per-example gradients (use a loss scale);
        fp32 master params, logits, norms, sum and noise."""
        return cls(compute=jnp.float16, grad=jnp.float16)

    # ---- string form ---------------------------------------------------------
    @classmethod
    def parse(cls, spec: str | Policy) -> Policy:
        """Parses ``"key=dtype,..."`` or a preset name (``fp32``, ``bf16``, ``fp16``).

        Keys (and aliases): param (params, p), compute (c), output (o),
        grad (grads, g), clip, accumulate (acc), noise, unsafe (true/false).
        Keys left out keep the float32 default. A preset may come first and be
        overridden: ``"bf16,output=bf16"``.
        """
        if isinstance(spec, Policy):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"policy: expected a string, got {type(spec).__name__}")
        fields: dict[str, Any] = {}
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if not items:
            raise ValueError("policy: empty string; give a preset (fp32, bf16, fp16) or key=dtype")
        presets = {
            "fp32": cls.fp32,
            "f32": cls.fp32,
            "bf16": cls.bf16,
            "fp16": cls.fp16,
            "f16": cls.fp16,
        }
        first = items[0].lower()
        if "=" not in first:
            if first not in presets:
                raise ValueError(
                    f"policy: unknown preset {items[0]!r}; allowed presets: fp32, bf16, fp16"
                )
            base = presets[first]()
            fields.update({r: getattr(base, r) for r in _ROLES})
            items = items[1:]
        for item in items:
            if "=" not in item:
                raise ValueError(
                    f"policy: {item!r} is not key=value (a preset may only come first)"
                )
            key, value = (s.strip() for s in item.split("=", 1))
            lkey = key.lower()
            if lkey == "unsafe":
                v = value.lower()
                if v not in _TRUE | _FALSE:
                    raise ValueError(f"policy: unsafe={value!r}; allowed: true, false")
                fields["allow_unsafe"] = v in _TRUE
                continue
            if lkey not in _KEY_ALIASES:
                raise ValueError(
                    f"policy: unknown key {key!r}; allowed: {', '.join(_ROLES)}, unsafe "
                    "(aliases: params, p, c, o, grads, g, acc)"
                )
            fields[_KEY_ALIASES[lkey]] = canonical_dtype(value, field=_KEY_ALIASES[lkey])
        return cls(**fields)

    def __str__(self) -> str:
        parts = [f"{role}={dtype_name(getattr(self, role))}" for role in _ROLES]
        if self.allow_unsafe:
            parts.append("unsafe=true")
        return ",".join(parts)

    def replace(self, **changes) -> Policy:
        """A copy with some roles changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- casting -------------------------------------------------------------
    def cast_to_param(self, tree):
        """Casts the floating leaves of ``tree`` to the param dtype."""
        return cast_tree(tree, self.param)

    def cast_to_compute(self, tree):
        """Casts the floating leaves of ``tree`` to the compute dtype."""
        return cast_tree(tree, self.compute)

    def cast_to_output(self, tree):
        """Casts the floating leaves of ``tree`` to the output dtype."""
        return cast_tree(tree, self.output)

    def cast_to_grad(self, tree):
        """Casts the floating leaves of ``tree`` to the grad dtype."""
        return cast_tree(tree, self.grad)

    @property
    def is_half(self) -> bool:
        """True when forward/backward or gradients run below float32."""
        return below_float32(self.compute) or below_float32(self.grad)
