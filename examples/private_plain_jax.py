"""Private training of a plain-JAX MLP on the digits data: a params dict, no flax.

The model is two functions you write yourself: ``init(key) -> params`` (a dict
of float32 arrays: the master copy) and ``loss_fn(params, batch)``. Under
``dpmp.private_grad`` the loss receives the params already cast to the policy's
grad dtype (bf16 here) and the batch features cast to its compute dtype, so the
matmuls, the per-example gradients and their memory are bf16; the norms, the
clipping, the sum over the batch and the noise are float32.

Expected output (2 CPU cores, 35-50 s; the accuracies vary between runs, 0.94
to 0.95 at the end in three: the noise and the batches are fresh and secret
each time):

    digits: 1437 train / 360 test; policy param=f32,compute=bf16,...
    noise multiplier 12.39 for epsilon 2 at delta 1e-05 over 300 steps (q = 0.3563)
    per-example gradient dtype inside the loss: bfloat16; clipped sum dtype: float32
    step   75  test accuracy 0.85  epsilon 0.934
    ...
    step  300  test accuracy 0.95  epsilon 1.999
    epsilon 1.999 (delta 1e-05), test accuracy 0.95

Run: ``python examples/private_plain_jax.py [--steps N]``
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import dpmp
from dpmp.data import split_positions

EPSILON, DELTA = 2.0, 1e-5
CLIP, BATCH, LEARNING_RATE = 1.0, 512, 7e-3
POLICY = dpmp.Policy.parse("bf16")
WIDTHS = (64, 256, 10)


def digits():
    """The digits and labels; pixels 0..16 mapped to [-1, 1] by that public range
    (x / 8 - 1), so no statistic of the private training data is computed."""
    x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float32) / 8 - 1, y.astype(np.int32)
    # held out by position, never by label: a stratified split would reveal the private labels
    train, test = split_positions(len(y), test_fraction=0.2, seed=0)
    return x[train], y[train], x[test], y[test]


def init(key):
    params = {}
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(sub, (a, b), jnp.float32) / jnp.sqrt(jnp.float32(a)),
            "b": jnp.zeros((b,), jnp.float32),
        }
    return params


def forward(params, x):
    x = x.astype(POLICY.compute)
    for i in range(len(WIDTHS) - 1):
        layer = params[f"layer{i}"]
        x = x @ layer["w"].astype(x.dtype) + layer["b"].astype(x.dtype)
        if i < len(WIDTHS) - 2:
            x = jax.nn.relu(x)
    return x.astype(jnp.float32)


def loss_fn(params, batch):
    logits = forward(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main(steps: int) -> float:
    x_train, y_train, x_test, y_test = digits()
    n = len(x_train)
    print(f"digits: {n} train / {len(x_test)} test; policy {POLICY}")

    # no seed: the sampler draws a secret one from the OS entropy
    sampler = dpmp.PoissonSampler(n, expected_batch_size=BATCH, num_steps=steps)
    params = init(jax.random.key(0))
    coords = sum(leaf.size for leaf in jax.tree.leaves(params))  # noised per step
    sigma = dpmp.accounting.calibrate_noise_multiplier(
        target_epsilon=EPSILON,
        sampling_prob=sampler.sampling_prob,
        steps=steps,
        delta=DELTA,
        noised_coordinates=coords,  # the snapped noise's residual is accounted per coordinate
    )
    print(
        f"noise multiplier {sigma:.4g} for epsilon {EPSILON:g} at delta {DELTA:g} over "
        f"{steps} steps (q = {sampler.sampling_prob:.4g})"
    )

    seen = {}

    def traced_loss(params, batch):  # records the dtype the loss is handed (at trace time)
        seen["params"] = params["layer0"]["w"].dtype
        return loss_fn(params, batch)

    grad_fn = dpmp.private_grad(traced_loss, l2_clip_norm=CLIP, policy=POLICY)
    # The noise is for the sum's sensitivity as computed: C plus a bound on its
    # rounding, from the padded batch size and the layers' shapes (explain reads them).
    grad_fn.explain(params, {"x": x_train[:1], "y": y_train[:1]})
    optimizer = dpmp.private_optimizer(  # no prng_key: a secret noise key from the OS
        optax.adam(LEARNING_RATE),
        noise_multiplier=sigma,
        l2_clip_norm=grad_fn.sensitivity(batch_size=sampler.padded_batch_size),
        expected_batch_size=BATCH,
        policy=POLICY,
    )
    opt_state = optimizer.init(params)
    sum_dtype = (
        jax.eval_shape(grad_fn, params, {"x": x_train[:BATCH], "y": y_train[:BATCH]})
        .grads["layer0"]["w"]
        .dtype
    )
    print(
        f"per-example gradient dtype inside the loss: {jnp.dtype(seen['params']).name}; "
        f"clipped sum dtype: {jnp.dtype(sum_dtype).name}"
    )

    @jax.jit
    def step(params, opt_state, batch, is_padding):
        out = grad_fn(params, batch, is_padding_example=is_padding)
        updates, opt_state = optimizer.update(out.grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    predict = jax.jit(forward)

    def test_accuracy(params):  # held-out data: public, unlike any training statistic
        return float(np.mean(np.argmax(np.asarray(predict(params, x_test)), -1) == y_test))

    report_every, eps = max(steps // 4, 1), 0.0
    for t, (indices, is_padding) in enumerate(sampler, start=1):
        rows = np.where(is_padding, 0, indices)
        batch = {"x": x_train[rows], "y": y_train[rows]}
        params, opt_state = step(params, opt_state, batch, is_padding)
        if t % report_every == 0 or t == steps:  # epsilon spent by the t steps taken
            eps = dpmp.accounting.epsilon(
                noise_multiplier=sigma,
                sampling_prob=sampler.sampling_prob,
                steps=t,
                delta=DELTA,
                noised_coordinates=coords,
            )
            print(f"step {t:>4}  test accuracy {test_accuracy(params):.2f}  epsilon {eps:.3f}")

    accuracy = test_accuracy(params)
    print(f"epsilon {eps:.3f} (delta {DELTA:g}), test accuracy {accuracy:.2f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    main(parser.parse_args().steps)
