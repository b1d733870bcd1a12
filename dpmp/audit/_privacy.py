"""Empirical privacy audit of a noise stage: one step, one canary, exact outputs.

The precision audit (``audit.py``) proves from the compiled step that the noise
is drawn and added in float32. This audit asks what an observer of the exact
released values can do. It runs the noise stage on two neighbouring inputs, the
clipped-gradient sum without a canary (``base``, dataset D') and with one
canary whose clipped gradient is ``C e_0`` (dataset D), ``num_releases`` times
each with fresh keys, and attacks the releases:

* **threshold attack**: says "canary in" when the released coordinate is above
  a threshold (chosen on one half of the releases, bounded on the other);
* **exact-value lookup attack**: says "canary in" when the released value is
  one the noise stage cannot produce without the canary. It needs the noise
  stage's set of possible outputs, which this module enumerates exactly when
  the noise is drawn by ``jax.random`` from at most 23 random bits per entry
  (``jax.random.normal`` in float32 and narrower): the stage is run once more
  with a key whose random bits are every bit pattern in turn. For dpmp's
  snapped Gaussian the possible outputs are the grid points between the
  stage's own extremes (run with crafted random bits).

Each attack's true and false positive rates get Clopper-Pearson bounds
(``jax_privacy.auditing.CanaryScoreAuditor``), giving a 1 - ``significance``
lower bound on epsilon at ``delta`` that is set beside the theoretical epsilon
of the same one-step Gaussian mechanism (sensitivity C, noise sigma C;
dp-accounting's PLD). A lower bound above the theoretical epsilon means the
implemented mechanism is not what the accountant analysed.

What it found (``tests/test_audit_privacy.py`` keeps each as a test):
``jax.random.normal`` in float32 is ``sqrt(2) erfinv`` of a uniform on 2^23
points, so with the canary at the origin most outputs under D are values that
no noise draw produces under D' (Mironov 2012, "On significance of the least
significant bits for differential privacy"); bf16 noise added in bf16 is
worse still. dpmp's default snapped Gaussian leaves no release impossible
under the neighbour within its 10-sigma reach.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import scipy.special
from dp_accounting.pld import privacy_loss_distribution as pld
from jax import lax
from jax_privacy import auditing as jp_auditing
from jax_privacy import noise_addition as jp_noise

from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER
from dpmp.noise._entropy import key_from
from dpmp.noise._noise import gaussian_privatizer
from dpmp.noise._registry import NoiseSampler, drawn_sampler, sampler, sampler_names
from dpmp.precision._policy import Policy

__all__ = ["PrivacyAuditReport", "privacy_audit", "MECHANISMS"]

# What ``mechanism`` may name besides a registered sampler (or the sampler object,
# audited as itself: ``dpmp.gaussian_privatizer`` drawing with it on the
# policy.accumulate sum); a GradientTransformation audits your own noise stage.
MECHANISMS = {
    "dpmp": "dpmp.gaussian_privatizer, the default: the default sampler's noise on the "
    "policy.accumulate sum",
    "naive": "jax-privacy's gaussian_privatizer with noise in policy.compute on a "
    "policy.compute sum (bf16 noise, bf16 noisy sum under a bf16 policy)",
}

# Candidate thresholds of the threshold attack.
_THRESHOLDS = 4095

# Enumeration covers samplers that read at most this many random bits per entry.
_ENUM_BITS = 23


@dataclasses.dataclass(frozen=True)
class PrivacyAuditReport:
    """What one audit measured. Epsilons are lower bounds with confidence
    1 - ``significance``; ``epsilon_theory`` is the accountant's value for the
    same one-step Gaussian mechanism."""

    mechanism: str
    noise_multiplier: float
    clip_norm: float
    delta: float
    num_releases: int
    sum_dtype: str
    release_dtype: str
    epsilon_theory: float
    epsilon_threshold: float
    epsilon_lookup: float | None
    impossible_share: float | None  # of the releases under D: impossible under D'
    impossible_share_reverse: float | None  # of the releases under D': impossible under D
    impossible_mass: float | None  # the same share, exact, from the enumeration
    distinct_noise_values: int | None
    significance: float
    note: str = ""

    @property
    def epsilon_empirical(self) -> float:
        """The larger of the two attacks' lower bounds."""
        return max(self.epsilon_threshold, self.epsilon_lookup or 0.0)

    @property
    def ok(self) -> bool:
        """No attack beats the theory, and no release is impossible under the neighbour."""
        impossible = max(self.impossible_share or 0.0, self.impossible_share_reverse or 0.0)
        return self.epsilon_empirical <= self.epsilon_theory and impossible == 0.0

    def leaks(self) -> list[str]:
        """One sentence per way the audited noise stage leaks (empty when ``ok``)."""
        out = []
        if self.impossible_share:
            out.append(
                f"{self.impossible_share:.1%} of the releases with the canary are values "
                "the noise stage cannot produce without it (exact-value lookup)"
            )
        if self.impossible_share_reverse:
            out.append(
                f"{self.impossible_share_reverse:.1%} of the releases without the canary "
                "are values it cannot produce with it"
            )
        if self.epsilon_threshold > self.epsilon_theory:
            out.append(
                f"the threshold attack's lower bound {self.epsilon_threshold:.2f} exceeds "
                f"the theoretical epsilon {self.epsilon_theory:.2f} (truncated or "
                "coarse noise)"
            )
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ok=self.ok, epsilon_empirical=self.epsilon_empirical, leaks=self.leaks())
        return d

    def __str__(self) -> str:
        def f(v, spec=".3f"):
            return "-" if v is None else format(v, spec)

        lines = [
            f"privacy audit of {self.mechanism}",
            f"  one step, canary C e_0 (C = {self.clip_norm:g}), sigma {self.noise_multiplier:g}, "
            f"delta {self.delta:g}, {self.num_releases:,} releases per dataset; sum "
            f"{self.sum_dtype}, release {self.release_dtype}",
            f"  theoretical epsilon                     {self.epsilon_theory:.3f}",
            f"  threshold attack, epsilon >=            {self.epsilon_threshold:.3f}",
            f"  exact-value lookup attack, epsilon >=   {f(self.epsilon_lookup)}",
            f"  releases impossible under the neighbour {f(self.impossible_share, '.4%')} "
            f"(D), {f(self.impossible_share_reverse, '.4%')} (D')",
            f"  exact share, from every noise value     {f(self.impossible_mass, '.4%')}"
            + (
                f" ({self.distinct_noise_values:,} distinct noise values)"
                if self.distinct_noise_values
                else ""
            ),
            f"  (lower bounds hold with confidence {1 - self.significance:.0%})",
        ]
        if self.note:
            lines.append(f"  note: {self.note}")
        leaks = self.leaks()
        lines.append("  verdict: OK" if not leaks else "  verdict: LEAKS")
        lines += [f"    - {s}" for s in leaks]
        return "\n".join(lines)


def theoretical_epsilon(noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of one Gaussian mechanism with noise_multiplier sigma."""
    if noise_multiplier == 0:
        return math.inf
    dist = pld.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, value_discretization_interval=1e-4
    )
    return float(dist.get_epsilon_for_delta(delta))


# ---- the noise stage ----------------------------------------------------------------


def _stage(mechanism, noise_multiplier, clip_norm, policy):
    """(description, privatizer, dtype of the sum it is fed, the sampler that draws
    its noise or None)."""
    stddev = float(noise_multiplier) * float(clip_norm)
    if isinstance(mechanism, optax.GradientTransformation):
        return "your noise stage", mechanism, policy.accumulate, None
    chosen = _sampler_of(mechanism)
    if chosen is not None:
        drawn = drawn_sampler(chosen, policy)
        priv = gaussian_privatizer(stddev=stddev, prng_key=0, policy=policy, sampler=chosen)
        name = f"dpmp.gaussian_privatizer ({drawn.name} noise, policy {policy})"
        return name, priv, policy.accumulate, drawn
    if mechanism == "naive":
        priv = jp_noise.gaussian_privatizer(
            stddev=stddev, prng_key=jax.random.key(0), dtype=policy.compute
        )
        name = jnp.dtype(policy.compute).name
        return f"the naive pipeline ({name} noise, {name} noisy sum)", priv, policy.compute, None
    raise ValueError(
        f"mechanism: must be one of {sorted(MECHANISMS)}, a registered sampler "
        f"({', '.join(sampler_names())}) or an optax GradientTransformation, got {mechanism!r}"
    )


def _sampler_of(mechanism) -> str | None:
    """The registered sampler ``mechanism`` names: ``"dpmp"`` is the default
    sampler; a ``NoiseSampler`` or a sampler's name is itself (it must be
    registered: the privatizer draws by name). None for anything else."""
    if isinstance(mechanism, NoiseSampler):
        return sampler(mechanism.name).name
    if mechanism == "dpmp":
        return DEFAULT_NOISE_SAMPLER
    if isinstance(mechanism, str) and mechanism in sampler_names():
        return mechanism
    return None


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _with_keys(state, keys):
    """``state`` with every PRNG key leaf replaced by ``keys`` (same for each leaf)."""
    found = []

    def swap(x):
        if _is_key(x):
            found.append(x)
            return keys
        return x

    out = jax.tree.map(swap, state)
    if not found:
        raise ValueError(
            "mechanism: its state holds no jax.random key, so the audit cannot give it "
            "fresh randomness per release (build it with a typed key, jax.random.key)"
        )
    return out


def _releases(priv, sum_value, keys):
    """The noise stage's release of ``sum_value`` (a length-1 vector) under each key."""
    state = priv.init(sum_value)

    def one(key):
        noisy, _ = priv.update(sum_value, _with_keys(state, key))
        return jax.tree.leaves(noisy)[0][0]

    return jax.jit(jax.vmap(one))(keys)


def _bits(x: np.ndarray) -> np.ndarray:
    """Exact identity of float values (-0.0 and 0.0 are different releases)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


# ---- enumeration of every value the noise stage can produce -------------------------


class _NotEnumerable(Exception):
    pass


def _enumerating_impl(calls: list):
    """A PRNG implementation whose ``random_bits`` gives entry i the bit pattern i
    in the top 23 bits (top 10 for 16-bit draws, 8 for 8-bit ones: each pattern
    equally often), so one draw of 2^23 entries meets every value a sampler that
    reads at most that many bits can produce, each as often as it is drawn."""

    def random_bits(key_data, bit_width, shape):
        n = math.prod(shape)
        calls.append(n)
        if bit_width > 32 or n != 2**_ENUM_BITS:
            raise _NotEnumerable(f"draws {bit_width}-bit words")
        i = lax.iota(jnp.uint32, n)
        if bit_width == 32:
            bits = i << (32 - _ENUM_BITS)
        else:
            top = min(bit_width, 10)
            bits = (i >> (_ENUM_BITS - top)) << (bit_width - top)
        dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width]
        return lax.convert_element_type(bits, dtype).reshape(shape)

    return _crafted_impl(random_bits, "dpmp_audit_enumerate")


def _crafted_impl(random_bits, name: str):
    """A PRNG implementation with the given ``random_bits``; every key is the same."""
    return jex.random.define_prng_impl(
        key_shape=(1,),
        seed=lambda seed: jnp.zeros((1,), jnp.uint32),
        split=lambda key, shape: jnp.zeros((*shape, 1), jnp.uint32),
        random_bits=random_bits,
        fold_in=lambda key, data: key,
        name=name,
    )


def _support(priv, sum_value):
    """Every release of ``sum_value`` (a length-1 vector) the stage can produce, as
    (sorted unique bit patterns, their probabilities), or None if its sampler reads
    more than 23 random bits per entry or more than one draw."""
    calls: list[int] = []
    impl = _enumerating_impl(calls)
    n = 2**_ENUM_BITS
    big = jnp.broadcast_to(sum_value, (n,))
    try:
        state = priv.init(big)
        key = jax.random.key(0, impl=impl)
        noisy, _ = jax.jit(priv.update)(big, _with_keys(state, key))
    except _NotEnumerable:
        return None
    if len(calls) != 1:
        return None
    values, counts = np.unique(_bits(np.asarray(jax.tree.leaves(noisy)[0])), return_counts=True)
    return values, counts / n


def _outside(values: np.ndarray, support_range, grid: float) -> np.ndarray:
    """Which of ``values`` a snapped stage cannot release: off ``grid`` or outside
    ``support_range`` (its smallest and largest release)."""
    low, high = support_range
    v = np.asarray(values, np.float64)
    return (v < low) | (v > high) | (np.round(v / grid) * grid != v)


def _impossible(bits: np.ndarray, support) -> np.ndarray:
    """Which of ``bits`` are not in ``support`` (sorted unique bit patterns)."""
    values = support[0]
    i = np.minimum(np.searchsorted(values, bits), len(values) - 1)
    return values[i] != bits


# ---- attacks --------------------------------------------------------------------------


def _epsilon_lower_bound(scores_in, scores_out, *, significance, delta, seed=None, threshold=None):
    auditor = jp_auditing.CanaryScoreAuditor(scores_in, scores_out)
    strategy = (
        jp_auditing.Split(seed=seed)
        if threshold is None
        else jp_auditing.Explicit(threshold=threshold)
    )
    return float(auditor.epsilon_clopper_pearson(significance, delta, threshold_strategy=strategy))


def _possible_sets(priv, drawn, stddev, with_canary, without, y_d, y_d_prime):
    """For the releases under D (``y_d``) and D' (``y_d_prime``): which are impossible
    under their own dataset, which under the other, the probability under D of
    releases impossible under D', and the number of values possible under D'. The
    sampler ``drawn`` says what it can release (``release_grid``); else its draws are
    enumerated. None when the stage's outputs cannot be determined here."""
    grids = (
        [None] if drawn is None else [drawn.release_grid(v, stddev) for v in (with_canary, without)]
    )
    if None not in grids:
        grid = grids[0][2]
        range_d, range_d_prime = ((low, high) for low, high, _ in grids)
        centre = float(with_canary[0])
        low, high = range_d_prime
        mass = float(
            scipy.special.ndtr((low - grid / 2 - centre) / stddev)
            + scipy.special.ndtr(-(high + grid / 2 - centre) / stddev)
        )
        return (
            _outside(y_d, range_d, grid),
            _outside(y_d_prime, range_d_prime, grid),
            _outside(y_d, range_d_prime, grid),
            _outside(y_d_prime, range_d, grid),
            mass,
            int(round((high - low) / grid)) + 1,
        )
    support_d, support_d_prime = _support(priv, with_canary), _support(priv, without)
    if support_d is None or support_d_prime is None:
        return None
    bits_d, bits_d_prime = _bits(y_d), _bits(y_d_prime)
    only_d = _impossible(support_d[0], support_d_prime)
    return (
        _impossible(bits_d, support_d),
        _impossible(bits_d_prime, support_d_prime),
        _impossible(bits_d, support_d_prime),
        _impossible(bits_d_prime, support_d),
        float(support_d[1][only_d].sum()),
        len(support_d_prime[0]),
    )


def privacy_audit(
    noise_multiplier: float,
    *,
    policy: Policy | str = "bf16",
    clip_norm: float = 1.0,
    delta: float = 1e-5,
    num_releases: int = 1_000_000,
    mechanism: str | NoiseSampler | optax.GradientTransformation = "dpmp",
    base: float = 0.0,
    significance: float = 0.05,
    prng_key: Any = None,
) -> PrivacyAuditReport:
    """White-box one-step canary audit of a noise stage under ``policy``.

    Feeds the stage the clipped-gradient sum ``base`` (without the canary) and
    ``base + clip_norm`` (with a canary whose clipped gradient is ``C e_0``), in
    the dtype the step would (``policy.accumulate`` for dpmp's stage), draws
    ``num_releases`` releases of each with fresh keys (vectorised over the keys),
    and returns the threshold and exact-value lookup attacks' epsilon lower bounds
    next to the theoretical epsilon (see the module docstring).

    ``mechanism`` is ``"dpmp"`` (the trainer's noise stage with its default
    sampler), a registered sampler (``dpmp.noise.NoiseSampler``, or its name:
    ``dpmp.gaussian_privatizer`` drawing with it, audited as itself through its
    ``release_grid``), ``"naive"`` (noise and sum in the compute dtype, as
    jax-privacy's privatizer does for a bf16 sum) or your own
    ``optax.GradientTransformation`` whose state holds a ``jax.random``
    key and whose ``update(sum, state)`` returns the noisy sum: its noise is then
    scaled however you built it, and ``noise_multiplier`` and ``clip_norm`` are
    what you claim for it. ``prng_key`` seeds the audit's own keys (None: fresh
    entropy); the audit releases nothing private, so any seed is fine here.
    """
    policy = Policy.parse(policy)
    noise_multiplier, clip_norm, num_releases = _checked(
        noise_multiplier, clip_norm, delta, num_releases, significance
    )
    name, priv, sum_dtype, drawn = _stage(mechanism, noise_multiplier, clip_norm, policy)

    without = jnp.full((1,), base, sum_dtype)
    with_canary = without + jnp.asarray(clip_norm, sum_dtype)
    key_d, key_d_prime, key_split = jax.random.split(key_from(prng_key), 3)
    keys_d = jax.random.split(key_d, num_releases)
    keys_d_prime = jax.random.split(key_d_prime, num_releases)
    y_d = np.asarray(_releases(priv, with_canary, keys_d))
    y_d_prime = np.asarray(_releases(priv, without, keys_d_prime))
    seed = int(jax.random.randint(key_split, (), 0, 2**31 - 1))

    # Thresholds from a fixed grid (Gaussian quantiles around the midpoint, dense in
    # the tails): a rule on the bucket index is a threshold rule, and the auditor's
    # cost grows with the number of distinct scores.
    levels = scipy.special.expit(np.linspace(-25.0, 25.0, _THRESHOLDS))
    grid = float(base) + clip_norm / 2 + noise_multiplier * clip_norm * scipy.special.ndtri(levels)
    eps_threshold = _epsilon_lower_bound(
        np.searchsorted(grid, y_d.astype(np.float64)).astype(np.float64),
        np.searchsorted(grid, y_d_prime.astype(np.float64)).astype(np.float64),
        significance=significance,
        delta=delta,
        seed=seed,
    )

    stddev = noise_multiplier * clip_norm
    found = _possible_sets(priv, drawn, stddev, with_canary, without, y_d, y_d_prime)
    lookup, share, share_rev, mass, distinct, note = _lookup_attack(found, significance, delta)
    return PrivacyAuditReport(
        mechanism=name,
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        delta=float(delta),
        num_releases=num_releases,
        sum_dtype=jnp.dtype(sum_dtype).name,
        release_dtype=y_d.dtype.name,
        epsilon_theory=theoretical_epsilon(noise_multiplier, delta),
        epsilon_threshold=eps_threshold,
        epsilon_lookup=lookup,
        impossible_share=share,
        impossible_share_reverse=share_rev,
        impossible_mass=mass,
        distinct_noise_values=distinct,
        significance=significance,
        note=note,
    )


def _checked(noise_multiplier, clip_norm, delta, num_releases, significance):
    """The arguments of ``privacy_audit`` validated: ``(noise_multiplier,
    clip_norm, num_releases)`` as float, float, int."""
    noise_multiplier = float(noise_multiplier)
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier: must be > 0, got {noise_multiplier!r}")
    clip_norm = float(clip_norm)
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm: must be a finite number > 0, got {clip_norm!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta: must be in (0, 1), got {delta!r}")
    if int(num_releases) != num_releases or num_releases < 100:
        raise ValueError(f"num_releases: must be an integer >= 100, got {num_releases!r}")
    if not 0 < significance < 0.5:
        raise ValueError(f"significance: must be in (0, 0.5), got {significance!r}")
    return noise_multiplier, clip_norm, int(num_releases)


def _lookup_attack(found, significance: float, delta: float):
    """The exact-value lookup attack on the sets ``_possible_sets`` found:
    ``(epsilon, impossible share, reverse share, impossible mass, distinct noise
    values, note)``; all ``None`` with a note when the outputs could not be
    enumerated."""
    if found is None:
        note = (
            "the noise stage reads more than 23 random bits per entry: its outputs cannot "
            "be enumerated here, so the exact-value lookup attack did not run"
        )
        return None, None, None, None, None, note
    own_d, own_d_prime, in_d, in_d_prime, mass, distinct = found
    if own_d.any() or own_d_prime.any():
        raise AssertionError(  # the support must cover what the stage produced
            "the enumeration missed values the noise stage produced; its sampler reads "
            "its random bits in a way this audit does not model"
        )
    both = [
        _epsilon_lower_bound(
            a.astype(np.float64),
            b.astype(np.float64),
            significance=significance / 2,
            delta=delta,
            threshold=0.5,
        )
        for a, b in ((in_d, own_d_prime), (in_d_prime, own_d))
    ]
    share, share_rev = float(in_d.mean()), float(in_d_prime.mean())
    return max(both), share, share_rev, mass, distinct, ""
