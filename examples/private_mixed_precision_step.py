"""The classic mixed-precision training step, made differentially private.

``examples/mixed_precision_step.py`` trains ``nn.Dense(1)`` with a flax
``TrainState``: bf16 compute, the loss scaled by 2^8 in fp32, the gradients
unscaled in fp32. Here the same step is private: Poisson-sampled batches,
per-example gradients clipped to C = 1 and summed, Gaussian noise, with

    out     = dpmp.private_grad(mse, l2_clip_norm=C, policy=POLICY)(
                  params, (x, y), loss_scale=dpmp.StaticLossScale(2**8),
                  is_padding_example=...)
    state   = state.apply_gradients(grads=out.grads)   # tx = dpmp.private_optimizer(...)

It shows three things:

1. The loss scale leaves BEFORE the per-example norm: the clipped sum with
   scale 2^8 equals the one with scale 1, and writing the step the obvious way
   (clip the scaled per-example gradients, then unscale) clips at C / 2^8.
2. The clipped sum, the noise and the noisy sum are float32 although the
   per-example gradients are bf16 (and ``dpmp.audit_precision`` proves it from
   the step's jaxpr).
3. The private step trains: the loss falls while epsilon grows.

Expected output (numbers vary slightly by platform):

    policy param=f32,compute=bf16,output=bf16,grad=bf16,clip=f32,accumulate=f32,noise=f32
    1. loss scale 256 removed before clipping: sum equals the unscaled one: True
       per-example norms 0.99 to 64 (C = 1); clipped, at most 1.0000
       clipping the scaled gradients, then unscaling: |sum| = 0.059 instead of 15
    2. per-example grads bfloat16; clipped sum float32; noisy sum float32
       audit of the private step: OK
    3. step      loss  epsilon
          1   22.6980    3.534
       ...
          5   20.9224    7.422
    the loss fell from 23.3085 to 20.9224: True

(A toy: 64 examples, noise multiplier 1, so epsilon is large; ``--table``
prints the audit, one row per norm, sum, noise draw, noise addition and update.
The sampler and the noise get fixed seeds so that the output above is
reproducible: that, and the exact loss printed in 3., make this demonstration
NOT private. A private run leaves the seeds out (secret OS entropy) and
publishes no exact training statistic.)

Run: ``python examples/private_mixed_precision_step.py [--steps N] [--table]``
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import dpmp

LOSS_SCALE = 2.0**8
CLIP, SIGMA, N, BATCH = 1.0, 1.0, 64, 32
POLICY = dpmp.Policy.parse("param=f32,compute=bf16,output=bf16,grad=bf16")


def mse(params, batch, apply_fn):
    """bf16 MSE of the batch it is given; params arrive in the grad dtype (bf16)."""
    x, y = POLICY.cast_to_compute(batch)
    pred = apply_fn({"params": params}, x)
    return jnp.mean((pred - y) ** 2)


def make_data():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (N, 3))
    y = x @ jax.random.normal(kw, (3, 1)) + 0.5
    return x, y


def main(steps: int, show_table: bool) -> bool:
    x, y = make_data()
    model = nn.Dense(1)
    params = model.init(jax.random.key(1), jnp.ones((1, 3)))["params"]
    # The per-example loss: (params, batch) -> scalar; apply_fn is fixed here.
    loss = jax.tree_util.Partial(mse, apply_fn=model.apply)
    grad_fn = dpmp.private_grad(loss, l2_clip_norm=CLIP, policy=POLICY)
    print(f"policy {POLICY}")

    # 1. The scale leaves before the norm.
    batch = (x[:BATCH], y[:BATCH])
    scaled = grad_fn(params, batch, loss_scale=dpmp.StaticLossScale(LOSS_SCALE))
    plain = grad_fn(params, batch, loss_scale=dpmp.NoOpLossScale())
    same = all(
        bool(jnp.allclose(a, b, rtol=1e-6, atol=1e-6))
        for a, b in zip(jax.tree.leaves(scaled.grads), jax.tree.leaves(plain.grads))
    )
    print(
        f"1. loss scale {LOSS_SCALE:g} removed before clipping: sum equals the unscaled one: {same}"
    )

    def per_example_scaled_grads(p):  # what a hand-written step clips: the SCALED gradient
        def one(xi, yi):
            p16 = dpmp.cast_tree(p, POLICY.grad)

            def scaled_loss(q):
                return loss(q, (xi[None], yi[None])).astype(jnp.float32) * LOSS_SCALE

            return jax.grad(scaled_loss)(p16)

        return jax.vmap(one)(*batch)

    g16 = per_example_scaled_grads(params)
    g = jax.tree.map(lambda a: a.astype(jnp.float32), g16)
    norms = jnp.sqrt(sum(jnp.sum(a.reshape(BATCH, -1) ** 2, axis=1) for a in jax.tree.leaves(g)))
    true_norms = norms / LOSS_SCALE
    factor = jnp.minimum(1.0, CLIP / true_norms)
    clipped_norms = true_norms * factor
    print(
        f"   per-example norms {float(true_norms.min()):.2g} to {float(true_norms.max()):.2g} "
        f"(C = {CLIP:g}); clipped, at most {float(clipped_norms.max()):.4f}"
    )
    wrong_factor = jnp.minimum(1.0, CLIP / norms)  # clip the scaled gradient, then unscale
    wrong = jax.tree.map(lambda a: jnp.einsum("b...,b->...", a, wrong_factor) / LOSS_SCALE, g)
    right_norm = jnp.sqrt(sum(jnp.sum(a**2) for a in jax.tree.leaves(plain.grads)))
    wrong_norm = jnp.sqrt(sum(jnp.sum(a**2) for a in jax.tree.leaves(wrong)))
    print(
        f"   clipping the scaled gradients, then unscaling: |sum| = {float(wrong_norm):.2g} "
        f"instead of {float(right_norm):.2g}"
    )

    # 2. dtypes: bf16 per-example gradients, float32 sum, noise and noisy sum.
    # Fixed seeds (sampler, noise): reproducible output, NOT private (see the docstring).
    sampler = dpmp.PoissonSampler(N, expected_batch_size=BATCH, seed=0, num_steps=steps)
    tx = dpmp.private_optimizer(
        optax.sgd(0.1),
        noise_multiplier=SIGMA,
        # the sum's sensitivity as computed (C plus a bound on its rounding)
        l2_clip_norm=grad_fn.sensitivity(batch_size=sampler.padded_batch_size),
        expected_batch_size=BATCH,
        prng_key=2,
        policy=POLICY,
    )
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    privatizer = dpmp.gaussian_privatizer(stddev=SIGMA * CLIP, prng_key=3, policy=POLICY)
    noisy, _ = privatizer.update(scaled.grads, privatizer.init(scaled.grads))
    leaf = jax.tree.leaves
    print(
        f"2. per-example grads {jnp.dtype(leaf(g16)[0].dtype).name}; "
        f"clipped sum {jnp.dtype(leaf(scaled.grads)[0].dtype).name}; "
        f"noisy sum {jnp.dtype(leaf(noisy)[0].dtype).name}"
    )

    def private_step(state, batch, is_padding, loss_scale):
        out = grad_fn(state.params, batch, loss_scale=loss_scale, is_padding_example=is_padding)
        return state.apply_gradients(grads=out.grads), out.loss_scale

    indices, is_padding = sampler.batch(0)
    rows = np.where(is_padding, 0, indices)
    report = dpmp.audit_precision(
        private_step,
        state,
        (x[rows], y[rows]),
        jnp.asarray(is_padding),
        dpmp.StaticLossScale(LOSS_SCALE),
        policy=POLICY,
        params_argnums=0,
        batch_argnums=1,
    )
    print(f"   audit of the private step: {'OK' if report.ok else 'FAILED'}")
    if show_table:
        print(report)

    # 3. Train: the loss (non-private monitoring of the full data) falls, epsilon grows.
    step = jax.jit(private_step)
    full_loss = jax.jit(lambda p: loss(p, (x, y)).astype(jnp.float32))
    scale = dpmp.StaticLossScale(LOSS_SCALE)
    first = float(full_loss(state.params))
    print(f"3. {'step':>4}  {'loss':>8}  {'epsilon':>7}")
    for t, (indices, is_padding) in enumerate(sampler, start=1):
        rows = np.where(is_padding, 0, indices)
        state, scale = step(state, (x[rows], y[rows]), jnp.asarray(is_padding), scale)
        eps = dpmp.accounting.epsilon(
            noise_multiplier=SIGMA,
            sampling_prob=sampler.sampling_prob,
            steps=t,
            delta=1e-5,
            noised_coordinates=sum(leaf.size for leaf in jax.tree.leaves(state.params)),
        )
        print(f"   {t:>4}  {float(full_loss(state.params)):>8.4f}  {eps:>7.3f}")
    last = float(full_loss(state.params))
    fell = last < first
    print(f"the loss fell from {first:.4f} to {last:.4f}: {fell}")
    return same and report.ok and fell


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--table", action="store_true", help="print the audit table")
    args = parser.parse_args()
    raise SystemExit(0 if main(args.steps, args.table) else 1)
