"""Audit the precision of your own DP-SGD step (plain jax + jax-privacy + optax).

The first step is written the obvious way for bf16 training: bf16 params and
batch handed to jax-privacy's ``clipped_grad`` and ``gaussian_privatizer``.
The audit finds where that breaks the privacy guarantee: the norms, the clip
factor and the sum over examples run in bf16, the noise is drawn in bf16 and
the noisy sum is cast back to bf16. The second step keeps float32 master
params, computes in bf16 inside the loss, and asks jax-privacy for a float32
sum and float32 noise; it audits clean. A numeric audit then measures the
clipped norms and the error of both sums against float64.

Expected output (numbers vary slightly by platform):

    broken step: FAILED, violations by kind: {'batch_reduction': 4, 'norm': 14, ...}
    fixed step: OK, sites by kind: {'batch_reduction': 4, 'norm': 10, ...}
    numeric, bf16 sum: max |clip(g_i)|/C = 1.005..., ..., ok = False
    numeric, f32 sum: max |clip(g_i)|/C = 1.0000001, ..., ok = True

A bf16 clip factor lets clipped norms overshoot C by ~0.5%; in float32 they
stay within a few ulps. Both sums differ from float64 by ~4e-3 relative: that
is the bf16 forward/backward pass, which does not affect the guarantee.

Run: python examples/audit_own_step.py [--table]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_privacy import clipping, noise_addition

from dpmp import audit_precision, numeric_audit

BF16, F32 = jnp.bfloat16, jnp.float32
CLIP, SIGMA, BATCH = 1.0, 1.0, 32


def init(rng, sizes=(16, 32, 10)):
    return [
        {
            "w": jnp.asarray(rng.normal(size=(a, b)) / a**0.5, F32),
            "b": jnp.zeros((b,), F32),
        }
        for a, b in zip(sizes[:-1], sizes[1:], strict=False)
    ]


def loss(params, batch):
    x, y = batch
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"].astype(x.dtype) + layer["b"].astype(x.dtype))
    logits = (x @ params[-1]["w"].astype(x.dtype) + params[-1]["b"].astype(x.dtype)).astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def broken_step_fn():
    grad = clipping.clipped_grad(loss, l2_clip_norm=CLIP, batch_argnums=1)
    noise = noise_addition.gaussian_privatizer(stddev=SIGMA * CLIP, prng_key=jax.random.key(0))
    opt = optax.sgd(0.1)

    def step(params, batch, noise_state, opt_state):
        summed = grad(params, batch)  # bf16 params -> bf16 per-example grads
        noisy, noise_state = noise.update(summed, noise_state)
        updates, opt_state = opt.update(jax.tree.map(lambda g: g / BATCH, noisy), opt_state)
        return optax.apply_updates(params, updates), noise_state, opt_state

    return step, noise, opt


def fixed_step_fn():
    def bf16_loss(params, batch):
        # compute in bf16, but differentiate with respect to the f32 master params
        x, y = batch
        return loss(params, (x.astype(BF16), y))

    grad = clipping.clipped_grad(bf16_loss, l2_clip_norm=CLIP, batch_argnums=1, dtype=F32)
    noise = noise_addition.gaussian_privatizer(
        stddev=SIGMA * CLIP, prng_key=jax.random.key(0), dtype=F32
    )
    opt = optax.sgd(0.1)

    def step(params, batch, noise_state, opt_state):
        summed = grad(params, batch)
        noisy, noise_state = noise.update(summed, noise_state)
        updates, opt_state = opt.update(jax.tree.map(lambda g: g / BATCH, noisy), opt_state)
        return optax.apply_updates(params, updates), noise_state, opt_state

    return step, noise, opt, grad


def main(show_table: bool) -> None:
    rng = np.random.default_rng(0)
    params = init(rng)
    x = rng.normal(size=(BATCH, 16))
    batch = (jnp.asarray(x, F32), jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32))

    p16 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), BF16), params)
    b16 = (jnp.asarray(x, BF16), batch[1])
    step, noise, opt = broken_step_fn()
    report = audit_precision(
        step, p16, b16, noise.init(p16), opt.init(p16), policy="bf16", expect=("noise_add",)
    )
    bad = {k: sum(1 for f in report.violations if f.kind == k) for k in report.counts()}
    print(f"broken step: {'OK' if report.ok else 'FAILED'}, violations by kind: {bad}")
    if show_table:
        print(report)

    step, noise, opt, grad = fixed_step_fn()
    report = audit_precision(
        step,
        params,
        batch,
        noise.init(params),
        opt.init(params),
        policy="bf16",
        expect=("batch_reduction", "norm", "noise_sample", "noise_add", "update"),
    )
    print(f"fixed step: {'OK' if report.ok else 'FAILED'}, sites by kind: {report.counts()}")
    if show_table:
        print(report)

    def broken_sum(p, b):
        return clipping.clipped_grad(loss, l2_clip_norm=CLIP, batch_argnums=1)(
            jax.tree.map(lambda x: x.astype(BF16), p), (b[0].astype(BF16), b[1])
        )

    reference = clipping.clipped_grad(loss, l2_clip_norm=CLIP, batch_argnums=1)
    for name, fn in (("bf16", broken_sum), ("f32", grad)):
        num = numeric_audit(
            fn,
            params,
            batch,
            l2_clip_norm=CLIP,
            policy="bf16",
            reference_fn=reference,
            max_examples=8,
        )
        print(
            f"numeric, {name} sum: max |clip(g_i)|/C = {num.max_clipped_norm_ratio:.7f}, "
            f"|s - s64|/|s64| = {num.rel_error:.1e}, ok = {num.ok}"
        )


if __name__ == "__main__":
    main("--table" in sys.argv)
