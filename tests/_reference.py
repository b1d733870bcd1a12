"""Independent float64 references for the private path (numpy + jax under x64)."""

import jax
import jax.numpy as jnp
import numpy as np


def mlp_init(d_in=16, hidden=32, d_out=4, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.normal(size=(hidden, d_out)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(d_out, np.float32),
    }


def mlp_loss(params, batch):
    """Mean softmax cross-entropy of a tanh MLP; runs in the dtype of its inputs."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = (h @ params["w2"] + params["b2"]).astype(jnp.promote_types(h.dtype, jnp.float32))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def classification_batch(n, d_in=16, d_out=4, seed=1, scale=3.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(n, d_in))).astype(np.float32)
    y = rng.integers(0, d_out, size=n).astype(np.int32)
    return {"x": x, "y": y}


def per_example_grads_f64(loss_fn, params, batch):
    """Per-example gradients in float64 (each a batch of one), as numpy pytrees."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)

        def one(x, y):
            b = {"x": x[None], "y": y[None]}
            return jax.grad(loss_fn)(p64, b)

        x64 = jnp.asarray(np.asarray(batch["x"], np.float64))
        g = jax.vmap(one)(x64, jnp.asarray(batch["y"]))
        return jax.tree.map(np.asarray, g)


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def clipped_sum_f64(per_example, clip_norm, keep=None):
    """Sum of per-example gradients clipped to clip_norm, in float64."""
    leaves = jax.tree.leaves(per_example)
    n = leaves[0].shape[0]
    flat_g = np.concatenate([np.reshape(x, (n, -1)) for x in leaves], axis=1)
    norms = np.linalg.norm(flat_g, axis=1)
    factor = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))
    if keep is not None:
        factor = factor * keep
    return flat_g.T @ factor, norms
