"""``privacy.mechanism = "banded_mf"``: noise correlated across steps, honest in floats.

Banded matrix factorization (Choquette-Choo et al., NeurIPS 2023; McKenna 2024,
"Scaling up the banded matrix factorization mechanism") releases, for the
steps' clipped sums ``X`` (one row a step), ``Y = C X + Z``: ``C`` a
lower-triangular ``b``-banded Toeplitz strategy with columns normalised to L2
norm 1, ``Z`` i.i.d. Gaussian of stddev ``sigma * D``. The model follows
``C^-1 Y = X + C^-1 Z``: noise that cancels in the prefix sums the parameters
are. The coefficients are jax-privacy's (``toeplitz.optimize_banded_toeplitz``,
the mean squared error of the prefix sums for the run's steps), computed when
the run is set up.

How the stream is drawn (``BandedMF.privatizer``), step ``t``, with ``c`` the
float32 coefficients, ``d_t`` the norm of column ``t`` of their Toeplitz matrix
and ``C'[t, s] = c_{t-s} / d_s`` (float64) the strategy realised::

    a_t = sum_{j=0}^{b-1} C'[t, t-j] g_{t-j}        # (C' X)_t, from b-1 kept sums
    y_t = snapped(a_t + z_t)                         # THE release: dpmp's snapped draw
    u_t = (y_t - sum_{j=1}^{b-1} c_j u_{t-j}) / c_0  # C'^-1 Y, from b-1 kept outputs
    x_t = d_t u_t                                    # what the optimizer gets

``a_t`` and the decoding are formed in float64, each in one elementwise pass
over its ring (the float64 ``a_t``, which the snapped draw makes ``y_t`` of in
place, is the one temporary the size of the model); the kept sums (exactly the
clipped sums, float32 or the accumulate dtype if wider), the kept outputs and
``x_t`` are in the noise dtype, float32 or wider whatever the policy. The state
is the index ``t``, the two ring buffers of ``b - 1`` vectors the size of the
trained parameters and the previous step's sum and output (written into the
rings when the next step begins, so that a donated ring is updated in place),
inside the optimizer state: a checkpoint keeps them and the noise key, and a
resumed run continues the same stream bit for bit.

Formal guarantees (the derivation, also in docs/privacy.md):
  * *What the analysis releases is what is drawn.* The accountant's mechanism is
    ``Y = C' X + Z`` (its largest column norm is ``column_norm``, 1 to float
    rounding of the coefficients). Each ``y_t`` is dpmp's snapped Gaussian
    release of the query ``a_t`` -- the same sampler, grid and accounting
    contract as a DP-SGD step -- and ``x_t`` is computed from ``y_0..y_t`` and
    public coefficients alone: post-processing. No bound on a linear
    combination of snapped residuals is needed: the correlation is applied
    after the release, never to the noise before it. (Adding ``C^-1 z`` to
    ``g_t`` in floats, jax-privacy's form, would put ``g_t``'s rounding lattice
    in the output: Mironov's attack on the low bits.)
  * *The query's sensitivity, in floats.* A record joins at most one step
    ``s`` of each ``b`` consecutive ones (b-cyclic Poisson sampling), and moves
    ``a_t`` only for ``t`` in ``[s, s + b)``: exactly, by ``C'[t, s] (g_s -
    g'_s)``, of L2 norm at most ``column_norm * D`` over those steps. Computed
    in float64 from exactly kept sums, each ``a_t`` is off its exact value by
    at most ``gamma_{b+1} sum_j |C'[t, t-j]| |g_{t-j}|`` per coordinate
    (``gamma_k = k u / (1 - k u)``, ``u = 2^-53``; Higham, Accuracy and
    Stability, 3.1), in L2 at most ``E = gamma_{b+1} row_l1 B D`` with
    ``|g| <= B D`` for a padded batch of ``B``. Both neighbours' ``a`` then
    differ by at most ``column_norm D + 2 sqrt(b) E`` over the ``b`` steps, so
    the noise is drawn for ``D`` times ``sensitivity_factor(B) = column_norm +
    2 sqrt(b) gamma_{b+1} row_l1 B`` (2,000 steps, 16 bands, B = 4096:
    1 + 2.4e-8, the coefficients' rounding; tests/test_banded_mf.py checks
    ``E`` against an exact sum).
  * *The snapped residual.* Each of the ``steps`` draws is a snapped release
    whose mean the neighbour moves by at most ``1 / sigma`` noise stddevs (a
    column's entries are at most 1), so ``GridNoiseContract.residual`` with one
    release per step holds as its derivation states it for DP-SGD: the whole
    output's density is a mixture, over the steps that sample the record, of
    products of per-step Gaussians, and the drawn-to-exact ratio of a mixture
    lies between its components'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmp.noise._noise import _lift_to, gaussian_privatizer
from dpmp.noise._sharding import NoiseSharding
from dpmp.precision._policy import Policy
from dpmp.precision._stages import STAGES

__all__ = [
    "STREAM_STAGES",
    "BandedMF",
    "BandedMFState",
    "StreamStage",
    "banded_mf_decode",
    "banded_mf_query",
    "optimized_coefs",
]


class BandedMFState(NamedTuple):
    """The correlated stream's state (a pytree; checkpointed with the optimizer's).

    Attributes:
      noise: the snapped sampler's state ``(key, inner)``: the secret key.
      index: int32 scalar, the next step ``t``.
      sums: the clipped sums of steps ``t - b .. t - 2``, a ring buffer: every
        leaf ``[b - 1, *leaf.shape]`` in the noise dtype (step ``s`` in slot
        ``s mod (b - 1)``).
      outputs: the decoded outputs ``u`` of the same steps, the same layout.
      last_sum: the clipped sum of step ``t - 1``, leaves of the parameters'
        shapes, written into ``sums`` (over step ``t - b``'s, which step ``t``
        does not use) when step ``t`` begins: a ring is only written before it
        is read, so a donating step updates it in place (``()`` for one band).
      last_output: ``u`` of step ``t - 1``, likewise for ``outputs``.
    """

    noise: Any
    index: jax.Array
    sums: Any
    outputs: Any
    last_sum: Any = ()
    last_output: Any = ()


@functools.lru_cache(maxsize=8)
def optimized_coefs(steps: int, bands: int, max_optimizer_steps: int = 250) -> tuple[float, ...]:
    """jax-privacy's banded Toeplitz coefficients for ``steps`` steps and ``bands``
    bands (``toeplitz.optimize_banded_toeplitz``, mean squared error of the prefix
    sums), L2 norm 1, in float64; memoised within a process (no cache on disk)."""
    from jax_privacy.matrix_factorization import toeplitz

    if bands == 1:
        return (1.0,)
    with jax.enable_x64(True):
        coef = toeplitz.optimize_banded_toeplitz(
            steps, bands, max_optimizer_steps=max_optimizer_steps
        )
        coef = np.asarray(coef, np.float64)
    return tuple(float(c) for c in coef / np.linalg.norm(coef))


@dataclasses.dataclass(frozen=True, eq=False)
class BandedMF:
    """A column-normalised ``b``-banded Toeplitz strategy for ``steps`` steps.

    Attributes:
      steps: the number of steps ``n`` the strategy is for.
      coefs: the ``b`` Toeplitz coefficients as used (float32 values, as floats).
    """

    steps: int
    coefs: tuple[float, ...]
    name: str = "banded_mf"

    @classmethod
    def optimized(cls, steps: int, bands: int) -> BandedMF:
        """jax-privacy's optimised coefficients for ``steps`` and ``bands``."""
        if not 1 <= bands <= steps:
            raise ValueError(f"bands: must be in [1, steps = {steps}], got {bands}")
        coefs = np.asarray(optimized_coefs(steps, bands), np.float32)
        return cls(steps=steps, coefs=tuple(float(c) for c in coefs))

    @property
    def bands(self) -> int:
        return len(self.coefs)

    def column_scales(self) -> np.ndarray:
        """``d``: float64 ``[steps]``, each the float32 value used for column ``t``'s
        norm in the Toeplitz matrix (the last ``b - 1`` columns are cut short)."""
        c = np.asarray(self.coefs, np.float64)
        full = np.zeros(self.steps)
        full[: min(self.bands, self.steps)] = c[: self.steps]
        norms = np.sqrt(np.cumsum(full**2))[::-1]
        return norms.astype(np.float32).astype(np.float64)

    def matrix(self) -> np.ndarray:
        """The strategy ``C'`` the stream realises, float64 ``[steps, steps]``:
        ``C'[t, s] = c_{t-s} / d_s`` (use for small ``steps``)."""
        n, c, d = self.steps, np.asarray(self.coefs, np.float64), self.column_scales()
        out = np.zeros((n, n))
        for j in range(min(self.bands, n)):
            idx = np.arange(n - j)
            out[idx + j, idx] = c[j] / d[idx]
        return out

    def _entries(self) -> list[np.ndarray]:
        """``C'[s + j, s]`` for each band ``j``: float64 arrays over the columns ``s``,
        divided as the stream divides them."""
        n, c, d = self.steps, np.asarray(self.coefs, np.float64), self.column_scales()
        return [c[j] / d[: n - j] for j in range(min(self.bands, n))]

    def column_norm(self) -> float:
        """The largest column L2 norm of ``C'`` (1 up to float32 rounding), rounded up."""
        sq = np.zeros(self.steps)
        for band in self._entries():
            sq[: len(band)] += band**2
        return float(np.sqrt(sq.max())) * (1 + 1e-12)

    def row_l1(self) -> float:
        """``max_t sum_j |C'[t, t - j]|``: the weight of one output's float sum."""
        rows = np.zeros(self.steps)
        for j, band in enumerate(self._entries()):
            rows[j:] += np.abs(band)
        return float(rows.max())

    def rounding_bound(self, batch_size: int, dtype: Any = np.float64) -> float:
        """``E / D``: a bound on the L2 rounding of one computed ``a_t`` per unit of
        the per-record sensitivity ``D``, for sums of ``batch_size`` records."""
        u = float(np.finfo(dtype).eps) / 2
        k = self.bands + 1
        gamma = k * u / (1 - k * u)
        return gamma * self.row_l1() * batch_size

    def sensitivity_factor(self, batch_size: int, dtype: Any = np.float64) -> float:
        """What the noise stddev ``sigma D`` is multiplied by (see the module
        docstring): ``column_norm + 2 sqrt(b) E / D``."""
        if self.bands == 1:
            return 1.0
        return self.column_norm() + 2 * math.sqrt(self.bands) * self.rounding_bound(
            batch_size, dtype
        )

    def prefix_rmse(self) -> float:
        """Root mean squared error of the ``steps`` prefix sums per unit of noise
        stddev: ``sqrt(mean_t |(A C'^-1)_t|^2)``, ``A`` the prefix-sum workload, as
        jax-privacy's ``banded.per_query_error`` computes it for the
        column-normalised strategy (DP-SGD's: ``sqrt((n + 1) / 2)``)."""
        from jax_privacy.matrix_factorization import banded

        with jax.enable_x64(True):
            strategy = banded.ColumnNormalizedBanded.from_banded_toeplitz(
                self.steps, jnp.asarray(self.coefs, jnp.float64)
            )
            err = banded.per_query_error(strategy)
            return float(jnp.sqrt(jnp.mean(err)))

    def describe(self) -> dict[str, Any]:
        """The report's record of the strategy (public: a function of the plan)."""
        return {
            "mechanism": self.name,
            "bands": self.bands,
            "steps": self.steps,
            "coefficients": [float(c) for c in self.coefs],
            "column_norm": self.column_norm(),
            "prefix_rmse_per_stddev": self.prefix_rmse(),
        }

    def privatizer(
        self,
        *,
        stddev: float,
        prng_key: Any = None,
        policy: Policy | str,
        sampler: str = "snapped",
        sharding: NoiseSharding | None = None,
    ) -> optax.GradientTransformation:
        """The correlated stream as an optax transformation (see the module
        docstring): ``update(sum_of_clipped_grads, state)`` returns ``x_t`` in the
        noise dtype; ``stddev`` is that of each snapped draw (``sigma D`` times
        ``sensitivity_factor``)."""
        policy = Policy.parse(policy)
        draw = gaussian_privatizer(
            stddev=stddev, prng_key=prng_key, policy=policy, sampler=sampler, sharding=sharding
        )
        m, dtype = self.bands - 1, jnp.promote_types(policy.accumulate, policy.noise)
        # d_t is the full norm up to step n - b, then the last b - 1 columns' own
        first = max(0, self.steps - self.bands)
        scales = self.column_scales()[first:]
        coefs = np.asarray(self.coefs, np.float64)

        def init(params):
            wide = _lift_to(params, dtype)

            def ring():  # two distinct buffers: a donating step writes each in place
                return jax.tree.map(lambda p: jnp.zeros((m, *p.shape), p.dtype), wide)

            def last():
                return jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), wide) if m else ()

            index = jnp.zeros((), jnp.int32)
            return BandedMFState(draw.init(params), index, ring(), ring(), last(), last())

        def update(sums, state, params=None):
            del params
            with jax.named_scope(STAGES["noise"]):
                sums = _lift_to(sums, dtype)
                for leaf in jax.tree.leaves(sums):
                    if leaf.dtype != dtype:  # a kept sum must be the sum, unrounded
                        raise ValueError(f"banded_mf: a {leaf.dtype} sum; keeps {dtype} sums")
                return _stream_step(draw, coefs, scales, first, m, sums, state)

        return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class StreamStage:
    """A stage of the stream that the precision audit checks, by the name of the jit
    it runs in (``dpmp/audit/rules/_correlated.py``): one per parameter leaf, called
    as ``stage(vector, ring, vector_weight, ring_weights)``.

    Attributes:
      jit_name: the jitted function's name (``eqn.params["name"]`` in a jaxpr).
      kind: the audit's kind of its sites (``dpmp.audit.KINDS``).
      vector: what its first input is.
      ring: what its ring buffer (the second input) holds; it must reach the
        policy's ``ring_role`` dtype (and float32: the audit's floor).
      ring_role: ``"accumulate"`` or ``"noise"``.
      result: what its output is.
      result_dtype: the dtype its output must reach: ``"float64"`` where the
        accounted rounding bound assumes it, else a policy role.
    """

    jit_name: str
    kind: str
    vector: str
    ring: str
    ring_role: str
    result: str
    result_dtype: str


def _combine(v, r, v_weight, weights):
    """``v_weight v + sum_k weights[k] r[k]`` in float64 (one leaf; see ``_weighted``)."""
    acc = v_weight * v.astype(jnp.float64)
    for k in range(r.shape[0]):  # unrolled: one elementwise pass over the ring
        acc = acc + weights[k] * r[k].astype(jnp.float64)
    return acc


@jax.jit
def banded_mf_query(v, r, v_weight, weights):
    """The release query ``a_t = (C' X)_t`` of one leaf, from the step's clipped sum
    ``v`` and the ring of kept sums ``r`` (a named jit: the audit's stage)."""
    return _combine(v, r, v_weight, weights)


@jax.jit
def banded_mf_decode(v, r, v_weight, weights):
    """``y_t - sum_j c_j u_{t-j}`` of one leaf, from the release ``v`` and the ring of
    kept outputs ``r`` (a named jit: the audit's stage)."""
    return _combine(v, r, v_weight, weights)


STREAM_STAGES = (
    StreamStage(
        jit_name="banded_mf_query",
        kind="batch_reduction",
        vector="the step's clipped sum",
        ring="ring buffer of the last b - 1 clipped sums (kept unrounded)",
        ring_role="accumulate",
        result="the release query a_t = (C' X)_t (its rounding bound is for float64)",
        result_dtype="float64",
    ),
    StreamStage(
        jit_name="banded_mf_decode",
        kind="noise_add",
        vector="the release y_t",
        ring="ring buffer of the last b - 1 decoded outputs",
        ring_role="noise",
        result="the decoding of C'^-1 Y (post-processing of the releases)",
        result_dtype="noise",
    ),
)


def _weighted(x, x_weight, ring, weights, stage=banded_mf_query):
    """``x_weight x + sum_k weights[k] ring[k]`` per leaf in float64: elementwise
    products and adds, no dot (no reduced-precision matmul on any backend), the
    slots added in order in one unrolled sum, in the named jit ``stage``: XLA
    fuses the conversions and adds into one pass over the ring that writes one
    float64 vector. (A ``fori_loop`` over the slots reads and writes that vector
    once per slot: on XLA:CPU, 2.9M parameters and 16 bands, the stream so, its
    rings also copied, took 0.34 s a step; now 0.14 s.) Any order of the ``b``
    additions is within ``BandedMF.rounding_bound``."""
    return jax.tree.map(lambda v, r: stage(v, r, x_weight, weights), x, ring)


def _written(ring, slot, vectors):
    """Each leaf's ring with ``vectors``' leaf in ``slot``: a dynamic-update-slice, which
    XLA does in place in a donated buffer (a scatter's ``.at[].set`` checks its
    bounds with a select over the whole ring, a copy)."""
    return jax.tree.map(
        lambda r, v: jax.lax.dynamic_update_index_in_dim(r, v.astype(r.dtype), slot, 0),
        ring,
        vectors,
    )


def _stream_step(draw, coefs, scales, first: int, m: int, sums, state: BandedMFState):
    """One step of the stream: ``(x_t, next state)``. ``scales[k]`` is ``d`` of step
    ``first + k`` (and of every step before); ``a_t`` and the decoding are formed
    in float64 (fused temporaries), the kept vectors and ``x_t`` in the noise dtype.

    Each ring is written before it is read: step ``t - 1``'s sum and output, kept
    aside, enter the rings first (over step ``t - b``'s, which step ``t`` does
    not use) and the query and the decoding read the rings so written. XLA
    orders an in-place update of a buffer after its reads only by data
    dependence: a ring read and then written copies the ring (twice, measured on
    XLA:CPU), unless everything that reads it is computed once and feeds the
    written vector, which XLA's fusion does not promise (it recomputes the
    decoding for ``x_t`` and for ``u_t`` apart)."""
    t = state.index
    sums_ring, out_ring = state.sums, state.outputs
    if m:
        prev = (t + m - 1) % m
        sums_ring = _written(state.sums, prev, state.last_sum)
        out_ring = _written(state.outputs, prev, state.last_output)
    with jax.enable_x64(True):
        c, d = jnp.asarray(coefs, jnp.float64), jnp.asarray(scales, jnp.float64)
        steps_back = t.astype(jnp.int64) - jnp.arange(m + 1)  # t - j, j = 0..b-1
        w = c / d[jnp.clip(steps_back - first, 0, len(scales) - 1)]  # C'[t, t - j]
        # the vectors of step t - j (j >= 1) sit in slot (t - j) mod m
        slots = steps_back[1:] % max(m, 1)
        sum_w = jnp.zeros((m,), jnp.float64).at[slots].set(w[1:])
        out_w = jnp.zeros((m,), jnp.float64).at[slots].set(-c[1:])
        a = _weighted(sums, w[0], sums_ring, sum_w, banded_mf_query)  # (C' X)_t
        y, noise = draw.update(a, state.noise)  # the release: snapped(a_t + z_t)
        back = _weighted(y, jnp.ones((), jnp.float64), out_ring, out_w, banded_mf_decode)
        d_t = d[jnp.clip(steps_back[0] - first, 0, len(scales) - 1)]
        u = jax.tree.map(lambda v: v / c[0], back)  # (C'^-1 Y)_t / d_t
        x = jax.tree.map(lambda v, g: (v * d_t).astype(g.dtype), u, sums)
        u = jax.tree.map(lambda v, g: v.astype(g.dtype), u, sums)
    if m == 0:
        return x, state._replace(noise=noise, index=t + 1)
    return x, BandedMFState(noise, t + 1, sums_ring, out_ring, sums, u)
