"""Private training of a flax nnx MLP on the digits data (nnx.split / nnx.merge).

An nnx model is a stateful Python object; DP-SGD needs a pure function of the
parameters. ``nnx.split`` separates the module into a static ``graphdef`` and
its ``nnx.State`` (a pytree of arrays); the loss ``nnx.merge`` s them back.
The state is what ``dpmp.private_grad`` differentiates (per example, cast to
bf16) and what ``dpmp.private_optimizer`` updates (fp32 noise, fp32 master
params). ``nnx.update`` writes the trained state back into the module.

    graphdef, state = nnx.split(model)
    loss_fn(state, batch) = cross_entropy(nnx.merge(graphdef, state)(batch["x"]))
    out      = dpmp.private_grad(loss_fn, ...)(state, batch, is_padding_example=...)
    updates  = dpmp.private_optimizer(optax.adam(...), ...).update(out.grads, ...)

Expected output (2 CPU cores, 35-50 s; the accuracies vary between runs, 0.93
to 0.96 at the end in three: the noise and the batches are fresh and secret
each time):

    digits: 1437 train / 360 test; policy param=f32,compute=bf16,...
    nnx.State with 4 arrays (19210 parameters), all float32
    noise multiplier 12.39 for epsilon 2 at delta 1e-05 over 300 steps (q = 0.3563)
    step   75  test accuracy 0.83  epsilon 0.934
    ...
    step  300  test accuracy 0.93  epsilon 1.999
    epsilon 1.999 (delta 1e-05), test accuracy 0.93

Run: ``python examples/private_nnx.py [--steps N]``
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import dpmp
from dpmp.data import split_positions

EPSILON, DELTA = 2.0, 1e-5
CLIP, BATCH, LEARNING_RATE = 1.0, 512, 7e-3
POLICY = dpmp.Policy.parse("bf16")


def digits():
    """The digits and labels; pixels 0..16 mapped to [-1, 1] by that public range
    (x / 8 - 1), so no statistic of the private training data is computed."""
    x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float32) / 8 - 1, y.astype(np.int32)
    # held out by position, never by label: a stratified split would reveal the private labels
    train, test = split_positions(len(y), test_fraction=0.2, seed=0)
    return x[train], y[train], x[test], y[test]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 256):
        kw = dict(dtype=POLICY.compute, param_dtype=jnp.float32, rngs=rngs)
        self.hidden = nnx.Linear(64, hidden, **kw)
        self.out = nnx.Linear(hidden, 10, **kw)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def main(steps: int) -> float:
    x_train, y_train, x_test, y_test = digits()
    n = len(x_train)
    print(f"digits: {n} train / {len(x_test)} test; policy {POLICY}")

    model = MLP(nnx.Rngs(params=0))
    graphdef, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    dtypes = {str(x.dtype) for x in leaves}
    print(
        f"nnx.State with {len(leaves)} arrays ({sum(x.size for x in leaves)} parameters), "
        f"all {', '.join(sorted(dtypes))}"
    )

    def loss_fn(state, batch):
        logits = nnx.merge(graphdef, state)(batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    # no seed: the sampler draws a secret one from the OS entropy
    sampler = dpmp.PoissonSampler(n, expected_batch_size=BATCH, num_steps=steps)
    coords = sum(leaf.size for leaf in jax.tree.leaves(state))  # noised per step
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
    grad_fn.explain(state, {"x": x_train[:1], "y": y_train[:1]})
    optimizer = dpmp.private_optimizer(  # no prng_key: a secret noise key from the OS
        optax.adam(LEARNING_RATE),
        noise_multiplier=sigma,
        l2_clip_norm=grad_fn.sensitivity(batch_size=sampler.padded_batch_size),
        expected_batch_size=BATCH,
        policy=POLICY,
    )
    opt_state = optimizer.init(state)

    @jax.jit
    def step(state, opt_state, batch, is_padding):
        out = grad_fn(state, batch, is_padding_example=is_padding)
        updates, opt_state = optimizer.update(out.grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    predict = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))

    def test_accuracy(state):  # held-out data: public, unlike any training statistic
        logits = np.asarray(predict(state, x_test), np.float32)
        return float(np.mean(np.argmax(logits, -1) == y_test))

    report_every, eps = max(steps // 4, 1), 0.0
    for t, (indices, is_padding) in enumerate(sampler, start=1):
        rows = np.where(is_padding, 0, indices)
        batch = {"x": x_train[rows], "y": y_train[rows]}
        state, opt_state = step(state, opt_state, batch, is_padding)
        if t % report_every == 0 or t == steps:  # epsilon spent by the t steps taken
            eps = dpmp.accounting.epsilon(
                noise_multiplier=sigma,
                sampling_prob=sampler.sampling_prob,
                steps=t,
                delta=DELTA,
                noised_coordinates=coords,
            )
            print(f"step {t:>4}  test accuracy {test_accuracy(state):.2f}  epsilon {eps:.3f}")

    nnx.update(model, state)  # the trained parameters, back in the module
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x_test))
    accuracy = float(np.mean(np.argmax(np.asarray(logits, np.float32), -1) == y_test))
    print(f"epsilon {eps:.3f} (delta {DELTA:g}), test accuracy {accuracy:.2f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    main(parser.parse_args().steps)
