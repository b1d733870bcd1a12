"""Private training of a flax linen MLP on the digits data, written out step by step.

What ``dpmp train`` does for the default config, with dpmp's public building
blocks and a model you write yourself:

    dpmp.accounting.calibrate_noise_multiplier   sigma for epsilon 2 at delta 1e-5
    dpmp.PoissonSampler                           Poisson batches, padded to one size
    dpmp.private_grad                             bf16 per-example grads, fp32 clip + sum
    dpmp.private_optimizer                        snapped fp-safe noise, / batch size, adam
    dpmp.accounting.epsilon                       what the steps taken have spent

The MLP is a plain ``nn.Module`` with ``dtype=bfloat16`` (compute) and
``param_dtype=float32`` (master params); ``private_grad`` casts the params to
the policy's grad dtype, so the per-example gradients are bf16, while the
norms, the clipping, the sum over the batch and the noise stay float32.

The features are the pixels mapped to [-1, 1] by their public range (no
statistic of the training data), the 360 held-out digits are the positions
``dpmp train`` holds out (``dpmp.data.split_positions``, seed 0), the sampler's
seed and the noise key are secret (OS entropy), and the only numbers printed
are the plan, epsilon and the test accuracy on held-out data.

Expected output (2 CPU cores, 35-50 s; the accuracies along the way vary between
runs, the last was 0.93 in each of three, since the noise and the batches are
fresh and secret each time; ``dpmp train``'s measurement is in the configs
table of docs/cli.md):

    digits: 1437 train / 360 test; policy param=f32,compute=bf16,...
    noise multiplier 12.39 for epsilon 2 at delta 1e-05 over 300 steps (q = 0.3563)
    step   75  test accuracy 0.84  epsilon 0.934
    step  150  test accuracy 0.89  epsilon 1.364
    step  225  test accuracy 0.92  epsilon 1.705
    step  300  test accuracy 0.93  epsilon 1.999
    epsilon 1.999 (delta 1e-05), test accuracy 0.93

Run: ``python examples/private_linen.py [--steps N]`` (fewer steps spend the
same epsilon with less noise per step, and reach a lower accuracy).
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import dpmp
from dpmp.data import split_positions

EPSILON, DELTA = 2.0, 1e-5
CLIP, BATCH, LEARNING_RATE = 1.0, 512, 7e-3
POLICY = dpmp.Policy.parse("bf16")  # bf16 compute and per-example grads; fp32 the rest


def digits():
    """The digits and labels; pixels 0..16 mapped to [-1, 1] by that public range
    (x / 8 - 1), so no statistic of the private training data is computed."""
    x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float32) / 8 - 1, y.astype(np.int32)
    # held out by position, never by label: a stratified split would reveal the private labels
    train, test = split_positions(len(y), test_fraction=0.2, seed=0)
    return x[train], y[train], x[test], y[test]


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, dtype=POLICY.compute, param_dtype=jnp.float32)(x))
        return nn.Dense(10, dtype=POLICY.compute, param_dtype=jnp.float32)(x)


MODEL = MLP()


def loss_fn(params, batch):
    """Mean cross-entropy of the batch it is given (private_grad hands it one example)."""
    logits = MODEL.apply({"params": params}, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main(steps: int) -> float:
    x_train, y_train, x_test, y_test = digits()
    n = len(x_train)
    print(f"digits: {n} train / {len(x_test)} test; policy {POLICY}")

    # no seed: the sampler draws a secret one from the OS entropy
    sampler = dpmp.PoissonSampler(n, expected_batch_size=BATCH, num_steps=steps)
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, 64), jnp.float32))["params"]
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

    grad_fn = dpmp.private_grad(loss_fn, l2_clip_norm=CLIP, policy=POLICY)
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

    @jax.jit
    def step(params, opt_state, batch, is_padding):
        out = grad_fn(params, batch, is_padding_example=is_padding)  # fp32 sum of clipped grads
        updates, opt_state = optimizer.update(out.grads, opt_state, params)  # + snapped noise
        return optax.apply_updates(params, updates), opt_state

    predict = jax.jit(lambda p, x: MODEL.apply({"params": p}, x))

    def test_accuracy(params):  # held-out data: public, unlike any training statistic
        logits = np.asarray(predict(params, x_test), np.float32)
        return float(np.mean(np.argmax(logits, -1) == y_test))

    report_every, eps = max(steps // 4, 1), 0.0
    for t, (indices, is_padding) in enumerate(sampler, start=1):
        rows = np.where(is_padding, 0, indices)  # padding rows: any example, masked out
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
