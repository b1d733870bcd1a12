"""The classic mixed-precision training step, written by hand and with dpmp.

A flax ``TrainState`` holding ``nn.Dense(1)`` and ``optax.sgd``: params, x and
y are cast to bf16 inside the loss, the MSE is computed in bf16, the loss is
scaled in fp32, the gradients are cast to fp32 and unscaled, the state applies
them, and the unscaled MSE is evaluated at the new params. The same step is
then written with ``dpmp.value_and_grad`` and a ``dpmp.Policy``.

Expected output (the two columns agree exactly; the loss falls step by step):

    step  loss (by hand)  loss (dpmp)   max |param diff|
       1        ...           ...            0.0
    ...
    by hand and dpmp agree exactly: True

Run: ``python examples/mixed_precision_step.py``
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import dpmp

BF16, F32 = jnp.bfloat16, jnp.float32
LOSS_SCALE = 2.0**8


def make_state(key):
    model = nn.Dense(1)
    params = model.init(key, jnp.ones((1, 3)))["params"]
    return model, train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1)
    )


# ---- by hand -------------------------------------------------------------------
def hand_loss(params, apply_fn, x, y):
    p16 = jax.tree.map(lambda a: a.astype(BF16), params)
    pred = apply_fn({"params": p16}, x.astype(BF16))
    return jnp.mean((pred - y.astype(BF16)) ** 2)  # bf16 MSE


@jax.jit
def hand_step(state, x, y):
    def scaled(params):
        return hand_loss(params, state.apply_fn, x, y).astype(F32) * LOSS_SCALE

    grads = jax.grad(scaled)(state.params)
    grads = jax.tree.map(lambda g: g.astype(F32) / LOSS_SCALE, grads)
    state = state.apply_gradients(grads=grads)
    return state, hand_loss(state.params, state.apply_fn, x, y).astype(F32)


# ---- with dpmp -------------------------------------------------------------------
POLICY = dpmp.Policy.parse("param=f32,compute=bf16,output=bf16,grad=bf16")


def dpmp_loss(params, apply_fn, x, y):
    x, y = POLICY.cast_to_compute((x, y))
    pred = apply_fn({"params": POLICY.cast_to_compute(params)}, x)
    return jnp.mean((pred - y) ** 2)


@jax.jit
def dpmp_step(state, loss_scale, x, y):
    out = dpmp.value_and_grad(dpmp_loss, policy=POLICY)(
        loss_scale, state.params, state.apply_fn, x, y
    )
    state = state.apply_gradients(grads=out.grads)
    new_loss = dpmp_loss(state.params, state.apply_fn, x, y).astype(F32)
    return state, out.loss_scale, new_loss


def main(steps: int = 5) -> bool:
    kx, kw, kinit = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (64, 3))
    y = x @ jax.random.normal(kw, (3, 1)) + 0.5
    _, s_hand = make_state(kinit)
    _, s_dpmp = make_state(kinit)
    scale = dpmp.StaticLossScale(LOSS_SCALE)
    agree = True
    print(f"{'step':>4}  {'loss (by hand)':>14}  {'loss (dpmp)':>11}  {'max |param diff|':>16}")
    for step in range(1, steps + 1):
        s_hand, l_hand = hand_step(s_hand, x, y)
        s_dpmp, scale, l_dpmp = dpmp_step(s_dpmp, scale, x, y)
        diff = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(s_hand.params), jax.tree.leaves(s_dpmp.params))
        )
        agree &= diff == 0.0 and float(l_hand) == float(l_dpmp)
        print(f"{step:>4}  {float(l_hand):>14.6f}  {float(l_dpmp):>11.6f}  {diff:>16.3g}")
    print(f"by hand and dpmp agree exactly: {agree}")
    return agree


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
