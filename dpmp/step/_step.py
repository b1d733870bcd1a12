"""The private step of a training loop, built from objects.

``private_step`` puts together what one DP-SGD step is made of -- the clipped
sum (a ``dpmp.private_grad`` function: model, loss, policy, clipping), the
noise and the optimizer (``dpmp.private_optimizer``), and optionally a
data-parallel mesh and physical chunks -- and returns a ``PrivateStepFn``. It
knows no run and no config file: the loop is the caller's. One step::

    batch    = Poisson sample of the training set, padded to a fixed size
    out      = grad_fn(params, batch, loss_scale, is_padding_example)
    updates  = private optimizer(out.grads)     # noise, / E[B], optax update
    params   = params + updates                 # fp32 master params

With ``physical_batch_size`` the logical batch is processed in chunks of that
many examples, one device call each::

    acc      = 0                                     # accumulate dtype (>= fp32)
    for chunk in physical_chunks(batch):             # every chunk, padding too
        acc += grad_fn(params, chunk, static scale, its padding).grads
    updates  = private optimizer(acc)                # ONE noise draw per step
    scale    = adjust_loss_scale(scale, overflow count of the whole batch)

so the compiled memory is set by the chunk, not by the logical batch. On a
``DataParallelMesh`` the batch (or each chunk) is split over the devices, the
clipped sums are all-reduced in the accumulate dtype and each device draws its
part of the noise (``dpmp.step._mesh`` says how).

The noise is drawn for the sensitivity of the sum AS COMPUTED::

    sensitivity = grad_fn.sensitivity_bound(batch_size=padded batch size,
                                            parts=physical chunks x devices)
    stddev      = noise_multiplier * sensitivity

which is the clip norm plus a bound on the floating-point rounding of the
clipped sum: the accountant's Gaussian mechanism with that noise multiplier,
exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmp.clipping._private_grad import (
    PrivateGradFn,
    PrivateGradStats,
    adjust_loss_scale,
    combine_stats,
)
from dpmp.noise._noise import NoiseSharding, private_optimizer
from dpmp.precision._loss_scale import NoOpLossScale, StaticLossScale
from dpmp.precision._stages import STAGES
from dpmp.step._mesh import AXIS, DataParallelMesh

__all__ = [
    "Chunked",
    "PrivateStepFn",
    "StepState",
    "WithFrozen",
    "physical_chunks",
    "private_step",
]


class StepState(NamedTuple):
    """What a private step carries from one step to the next (a pytree).

    Attributes:
      params: the float32 master parameters.
      opt_state: the private optimizer's state (the secret noise key inside).
      loss_scale: a ``dpmp`` loss scale (``NoOpLossScale``, ``StaticLossScale``,
        ``DynamicLossScale``, ``PrivateDynamicLossScale``).
    """

    params: Any
    opt_state: Any
    loss_scale: Any


class Chunked(NamedTuple):
    """The pieces of a step over physical chunks of its batch.

    Attributes:
      size: the physical batch size (rows per chunk).
      chunk_fn: jitted ``chunk_fn(params, chunk, is_padding, loss_scale, acc) ->
        (acc, stats)``, adding one chunk's clipped sum to ``acc`` (a
        ``WithFrozen`` when the step has frozen arrays).
      apply_fn: jitted ``apply_fn(params, acc, opt_state, loss_scale,
        num_nonfinite) -> (params, opt_state, loss_scale, noised_count)``: the
        noise and the update from the whole batch's clipped sum.
      chunks: ``chunks(batch, is_padding_example)`` yields ``chunk_fn``'s
        ``(chunk, is_padding)``.
      zeros: ``zeros()`` is the empty sum ``chunk_fn`` starts from.
    """

    size: int
    chunk_fn: Callable
    apply_fn: Callable
    chunks: Callable
    zeros: Callable


@dataclasses.dataclass(frozen=True, eq=False)
class WithFrozen:
    """``fn(*args)`` is ``jitted(*args, frozen)``: a compiled function whose last
    argument, the frozen arrays (a LoRA base), is bound. They are passed to the
    program at every call, as an argument in their own dtype, never folded into
    it as constants; ``lower(*args)`` lowers it the same way.

    Attributes:
      jitted: the ``jax.jit`` function, frozen arrays last.
      frozen: the frozen arrays (a pytree).
    """

    jitted: Callable
    frozen: Any

    def __call__(self, *args):
        return self.jitted(*args, self.frozen)

    def lower(self, *args):
        return self.jitted.lower(*args, self.frozen)


def _bound(jitted: Callable, frozen: Any) -> Callable:
    """``jitted`` with its last argument ``frozen`` bound; ``jitted`` itself without."""
    return jitted if frozen is None else WithFrozen(jitted, frozen)


@dataclasses.dataclass(frozen=True, eq=False)
class PrivateStepFn:
    """A private training step (``private_step`` builds it); the loop is the caller's::

        step  = dpmp.private_step(grad_fn, optax.adam(1e-3), params=params,
                                  batch=example_batch, noise_multiplier=sigma,
                                  expected_batch_size=256,
                                  padded_batch_size=sampler.padded_batch_size)
        state = step.init(params)                       # StepState
        for t in range(steps):
            sampled = sampler.batch(t)                  # dpmp.PoissonSampler
            rows = np.where(sampled.is_padding_example, 0, sampled.indices)
            batch = {"x": x_train[rows], "y": y_train[rows]}
            state, stats = step(state, *step.put_batch(batch, sampled.is_padding_example))
            epsilon = tracker.step()                    # dpmp.accounting

    ``examples/own_loop.py`` is this loop, runnable.

    Attributes:
      step_fn: ``step_fn(params, batch, is_padding_example, opt_state,
        loss_scale) -> (params, opt_state, loss_scale, stats)``, with ``batch``
        a pytree of ``[B, ...]`` arrays and ``is_padding_example`` ``[B]`` bool
        (``put_batch`` lays them out). Jitted as a whole, or, with physical
        chunks, a Python loop over ``chunked.chunk_fn`` then ``chunked.apply_fn``
        (it can be traced, so the precision audit reads it as one function).
        With frozen arrays, the jitted function takes them last and ``step_fn``
        is it with them bound (``WithFrozen``).
      grad_fn: the ``dpmp.private_grad`` function inside ``step_fn``.
      optimizer: the private optimizer: noise, ``1 / expected_batch_size``, the
        optax update.
      sensitivity: ``grad_fn.sensitivity_bound(...)`` for the padded batch and
        its partial sums (physical chunks times devices): ``"sensitivity"`` is
        the L2 sensitivity the noise is drawn for, the other keys its terms.
      mesh: the ``DataParallelMesh``, or None on one device.
      param_specs: on a mesh with sharded parameters, the ``PartitionSpec`` of
        each parameter; else None.
      chunked: the pieces of a step over physical chunks, or None.
      frozen: the frozen arrays ``grad_fn`` is given after the batch, or None.
      strategy: the noise mechanism's strategy (correlated noise), or None (DP-SGD).
    """

    step_fn: Callable
    grad_fn: PrivateGradFn
    optimizer: optax.GradientTransformation
    sensitivity: dict[str, Any]
    mesh: DataParallelMesh | None = None
    param_specs: Any = None
    chunked: Chunked | None = None
    frozen: Any = None
    strategy: Any = None

    def init(self, params: Any, loss_scale: Any = None) -> StepState:
        """The first ``StepState``: ``params``, the optimizer's initial state and
        ``loss_scale`` (default ``NoOpLossScale()``), on the mesh if there is one."""
        loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
        state = StepState(params, self.optimizer.init(params), loss_scale)
        if self.mesh is None:
            return state
        placed = self.mesh.put(state._asdict(), self.state_shardings(state)._asdict())
        return StepState(**placed)

    def state_shardings(self, state: StepState) -> StepState | None:
        """The sharding of every leaf of ``state`` on the mesh (None without one):
        replicated, or the parameters and their optimizer slots sharded."""
        if self.mesh is None:
            return None
        return StepState(**self.mesh.state_shardings(state._asdict(), self.param_specs))

    def put_batch(self, batch: Any, is_padding_example: np.ndarray) -> tuple[Any, Any]:
        """``(batch, is_padding_example)`` as ``step_fn`` takes them: unchanged on one
        device, split over the mesh (and laid out in physical chunks) on several.
        The arrays are the whole padded batch, ``[B, ...]`` and ``[B]``, in this
        process (a run of several processes reads its rows with ``mesh.put_batch``)."""
        if self.mesh is None:
            return batch, is_padding_example

        def rows(start, stop):
            part = slice(start, stop)
            return jax.tree.map(lambda v: np.asarray(v)[part], (batch, is_padding_example))

        size = None if self.chunked is None else self.chunked.size
        return self.mesh.put_batch(rows, len(is_padding_example), size)

    def __call__(
        self, state: StepState, batch: Any, is_padding_example: Any
    ) -> tuple[StepState, PrivateGradStats]:
        """One private step: the next ``StepState`` and the step's (exact, private)
        clipping statistics."""
        params, opt_state, loss_scale, stats = self.step_fn(
            state.params, batch, is_padding_example, state.opt_state, state.loss_scale
        )
        return StepState(params, opt_state, loss_scale), stats


def private_step(
    grad_fn: PrivateGradFn,
    optimizer: optax.GradientTransformation,
    *,
    params: Any,
    batch: Any,
    noise_multiplier: float,
    noise_key: jax.Array | None = None,
    expected_batch_size: int,
    padded_batch_size: int,
    noise_sampler: str = "snapped",
    physical_batch_size: int | None = None,
    mesh: DataParallelMesh | None = None,
    shard_params: bool = False,
    frozen: Any = None,
    donate: bool = False,
    strategy: Any = None,
) -> PrivateStepFn:
    """The private step of ``grad_fn`` and ``optimizer`` (see ``PrivateStepFn``).

    Args:
      grad_fn: ``dpmp.private_grad(loss_fn, l2_clip_norm=..., policy=...)``: the
        model, its loss, the precision policy and the clipping.
      optimizer: the optax optimizer of the (noised, averaged) gradient.
      params: the parameters, or their ``jax.ShapeDtypeStruct``s (shapes only).
      batch: a batch ``grad_fn`` can take (arrays or ``jax.ShapeDtypeStruct``s,
        any number of rows it accepts): the shapes of one example.
      noise_multiplier: sigma, from ``dpmp.accounting.calibrate_noise_multiplier``.
      noise_key: the secret PRNG key of the noise; None draws a fresh one from
        the OS entropy (a key anyone else knows voids the guarantee).
      expected_batch_size: the Poisson sampler's expected batch size (the
        noised sum is divided by it).
      padded_batch_size: the fixed size every batch is padded to.
      noise_sampler: how the noise is drawn, as ``dpmp.private_optimizer``'s
        ``sampler`` (``"snapped"`` or ``"plain"``).
      physical_batch_size: rows per device call; the padded batch must be a
        multiple of it (None: the whole batch in one call).
      mesh: a ``DataParallelMesh`` to split every batch (or chunk) over; None for
        one device.
      shard_params: shard the parameters and optimizer state over ``mesh``.
      frozen: arrays the loss reads but never trains (a LoRA model's base,
        ``model.frozen``), or None. ``grad_fn`` is then called as
        ``grad_fn(params, batch, frozen, ...)`` (its loss as ``loss_fn(params,
        batch, frozen)``: not differentiated, not split over the batch, the
        same for every example), and every compiled function of the step takes
        them as an argument (``WithFrozen``), in their own dtype: the program
        does not grow with them and they are not copied into it.
      donate: the step takes over the buffers of the ``params`` and
        ``opt_state`` it is given, and writes the new ones in them (``jax.jit``'s
        ``donate_argnums``): the arrays passed in are deleted, so a loop of
        ``state = step(state, ...)`` is right and reading an old state after
        its step is an error. Adam's float32 step then holds one copy of the
        parameters and of each moment, not two (compiled, in bytes per
        parameter: a 2.9M-parameter MLP 18.6, not 26.1; a 104M-parameter one
        14.1, not 24.7). On XLA:GPU, which runs the step as CUDA graphs and
        updates them on the host whenever a buffer moves, the donated buffers
        stay where they were.
      strategy: a noise mechanism's strategy (``dpmp.noise._banded_mf.BandedMF``):
        the noise is correlated across steps, drawn for the sensitivity times its
        ``sensitivity_factor(padded_batch_size)``; None: DP-SGD.

    Raises:
      ValueError: ``shard_params`` without a mesh, or a padded batch that the
        physical chunks do not divide.
    """
    if shard_params and mesh is None:
        raise ValueError("shard_params: shards over a mesh; give mesh=DataParallelMesh(...)")
    size = physical_batch_size
    if size is not None and padded_batch_size % size:
        raise ValueError(
            f"physical_batch_size: {size} does not divide the padded batch {padded_batch_size}"
        )
    specs = mesh.param_specs(params) if shard_params else None
    # tracing grad_fn once also tells it the model's shapes its sensitivity needs
    extra = () if frozen is None else (frozen,)
    acc_shapes = jax.eval_shape(lambda p, b, *f: grad_fn(p, b, *f).grads, params, batch, *extra)
    parts = (1 if size is None else padded_batch_size // size) * (mesh.size if mesh else 1)
    sensitivity = grad_fn.sensitivity_bound(batch_size=padded_batch_size, parts=parts)
    factor = 1.0 if strategy is None else strategy.sensitivity_factor(padded_batch_size)
    noised = private_optimizer(
        optimizer,
        noise_multiplier=noise_multiplier,
        l2_clip_norm=sensitivity["sensitivity"] * factor,
        strategy=strategy,
        expected_batch_size=expected_batch_size,
        prng_key=noise_key,
        policy=grad_fn.policy,
        sampler=noise_sampler,
        # on a mesh each device draws only its part of the noise (the same values)
        sharding=None if mesh is None else NoiseSharding(mesh.mesh, AXIS, specs),
    )
    sum_fn = _summed(grad_fn) if mesh is None else mesh.summed(grad_fn, specs, len(extra))
    if size is None:
        step_fn, chunked = _bound(_whole_step(sum_fn, noised, donate), frozen), None
    else:
        chunked = _chunked_parts(sum_fn, noised, mesh, specs, size, acc_shapes, frozen, donate)
        step_fn = _chunked_step(chunked)
    return PrivateStepFn(
        step_fn=step_fn,
        grad_fn=grad_fn,
        optimizer=noised,
        sensitivity=sensitivity,
        mesh=mesh,
        param_specs=specs,
        chunked=chunked,
        frozen=frozen,
        strategy=strategy,
    )


def physical_chunks(
    batch: dict[str, np.ndarray], pad: np.ndarray, size: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Consecutive chunks of ``size`` rows of a padded batch (its length is a multiple).

    Every chunk is processed, padding-only ones included, so that a step's
    time does not depend on how many examples were sampled.
    """
    n = len(pad)
    if n % size:
        raise ValueError(f"physical_batch_size: {size} does not divide the padded batch {n}")
    for start in range(0, n, size):
        yield {k: v[start : start + size] for k, v in batch.items()}, pad[start : start + size]


def _summed(grad_fn) -> Callable:
    """``sum_fn(params, batch, pad, scale, *frozen) -> (clipped sum, stats)`` on one
    device."""

    def sum_fn(params, batch, pad, scale, *frozen):
        out = grad_fn(params, batch, *frozen, loss_scale=scale, is_padding_example=pad)
        return out.grads, out.stats

    return sum_fn


def _static(loss_scale):
    """The scale every part of a step uses; it is adjusted once, from the whole
    batch's overflow count, after the parts."""
    if isinstance(loss_scale, NoOpLossScale | StaticLossScale):
        return loss_scale
    return StaticLossScale(loss_scale.loss_scale)


def _apply(optimizer, params, grads, opt_state, loss_scale, num_nonfinite):
    """Noise, update and the next loss scale, from a step's clipped sum."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    with jax.named_scope(STAGES["optimizer"]):
        params = optax.apply_updates(params, updates)
    next_scale, noised = adjust_loss_scale(loss_scale, num_nonfinite)
    return params, opt_state, next_scale, noised


def _whole_step(sum_fn, optimizer, donate: bool = False) -> Callable:
    """A step over the whole batch in one call, with the scale adjusted after the sum
    (so that a mesh's devices see one scale, and the adjustment reads their total);
    ``donate``: it takes over the parameters' and the optimizer state's buffers."""

    def private_step(params, batch, is_padding_example, opt_state, loss_scale, *frozen):
        grads, stats = sum_fn(params, batch, is_padding_example, _static(loss_scale), *frozen)
        params, opt_state, next_scale, noised = _apply(
            optimizer, params, grads, opt_state, loss_scale, stats.num_nonfinite
        )
        return params, opt_state, next_scale, stats._replace(noised_overflow_count=noised)

    return jax.jit(private_step, donate_argnums=(0, 3) if donate else ())


def _chunked_parts(
    sum_fn, optimizer, mesh, specs, size: int, acc_shapes, frozen, donate: bool = False
) -> Chunked:
    """The ``Chunked`` pieces over physical chunks of ``size`` rows, on one device or
    a mesh (its parameters replicated, or sharded as ``specs`` say); ``chunk_fn``
    with the ``frozen`` arrays bound (``WithFrozen``) when there are some.
    ``chunk_fn`` adds to the sum in place (its buffers are the step's own);
    ``donate``: ``apply_fn`` takes over the parameters' and the optimizer state's."""
    if mesh is None:
        chunks = functools.partial(physical_chunks, size=size)
        shardings = None
    else:
        chunks = mesh.chunks
        shardings = mesh.state_shardings({"params": acc_shapes, "opt_state": ()}, specs)["params"]
    zeros = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shapes),
        out_shardings=shardings,
    )

    @functools.partial(jax.jit, donate_argnums=4)
    def chunk_fn(params, chunk, is_padding, loss_scale, acc, *frozen):
        grads, stats = sum_fn(params, chunk, is_padding, loss_scale, *frozen)
        return jax.tree.map(jnp.add, acc, grads), stats

    apply_fn = jax.jit(
        functools.partial(_apply, optimizer), donate_argnums=(0, 2) if donate else ()
    )
    chunk_fn = _bound(chunk_fn, frozen)
    return Chunked(size=size, chunk_fn=chunk_fn, apply_fn=apply_fn, chunks=chunks, zeros=zeros)


def _chunked_step(parts: Chunked) -> Callable:
    """``step_fn`` of a step over the physical chunks ``parts.chunks`` yields."""

    def step_fn(params, batch, is_padding_example, opt_state, loss_scale):
        chunk_scale = _static(loss_scale)
        acc = parts.zeros()
        stats = []
        for chunk, pad in parts.chunks(batch, is_padding_example):
            acc, chunk_stats = parts.chunk_fn(params, chunk, pad, chunk_scale, acc)
            stats.append(chunk_stats)
        total = combine_stats(stats)
        params, opt_state, next_scale, noised = parts.apply_fn(
            params, acc, opt_state, loss_scale, total.num_nonfinite
        )
        return params, opt_state, next_scale, total._replace(noised_overflow_count=noised)

    return step_fn
