"""Tests for the Poisson and shuffled samplers, checked statistically with scipy."""

import json

import numpy as np
import pytest
from scipy import stats

from dpmp.data._sampling import PoissonSampler, SampledBatch, ShuffledSampler

# Significance level for the statistical tests; each uses its own fixed seed,
# so they are deterministic, and a correct sampler passes them.
ALPHA = 1e-3


def _draw(sampler, steps):
    return [next(sampler) for _ in range(steps)]


def _real(batch):
    return batch.indices[~batch.is_padding_example]


def _inclusion_counts(batches, n):
    counts = np.zeros(n, dtype=np.int64)
    for batch in batches:
        np.add.at(counts, _real(batch), 1)
    return counts


def _inclusion_pvalue(counts, steps, q):
    """Chi-square test that independent per-example counts are Binomial(steps, q)."""
    z2 = (counts - steps * q) ** 2 / (steps * q * (1 - q))
    return stats.chi2.sf(z2.sum(), df=counts.size)


def _size_pvalue(sizes, n, q):
    """Chi-square goodness of fit of batch sizes to Binomial(n, q), bins with >= 5 expected."""
    lo, hi = int(stats.binom.ppf(1e-4, n, q)), int(stats.binom.isf(1e-4, n, q))
    edges = np.arange(lo, hi + 1)
    probs = np.diff(np.concatenate([[0.0], stats.binom.cdf(edges, n, q), [1.0]]))
    observed = np.bincount(np.searchsorted(edges, sizes), minlength=probs.size)
    expected = probs * len(sizes)
    # Merge neighbouring bins until each expects at least 5.
    obs_bins, exp_bins, o, e = [], [], 0, 0.0
    for ob, ex in zip(observed, expected, strict=True):
        o, e = o + ob, e + ex
        if e >= 5:
            obs_bins.append(o)
            exp_bins.append(e)
            o, e = 0, 0.0
    obs_bins[-1] += o
    exp_bins[-1] += e
    return stats.chisquare(obs_bins, exp_bins).pvalue


@pytest.fixture(scope="module")
def poisson_run():
    n, q, steps = 200, 0.1, 2000
    sampler = PoissonSampler(n, sampling_prob=q, seed=1234)
    return n, q, steps, sampler, _draw(sampler, steps)


def test_each_example_is_included_with_probability_q(poisson_run):
    n, q, steps, _, batches = poisson_run
    counts = _inclusion_counts(batches, n)
    assert _inclusion_pvalue(counts, steps, q) > ALPHA
    # No single example is far off either (Bonferroni over the n examples).
    pvalues = [stats.binomtest(int(c), steps, q).pvalue for c in counts]
    assert min(pvalues) > ALPHA / n
    # The same test rejects a sampler whose q is 10% off.
    assert _inclusion_pvalue(counts, steps, q * 1.1) < ALPHA


def test_batch_sizes_are_binomial(poisson_run):
    n, q, _, _, batches = poisson_run
    sizes = np.array([_real(b).size for b in batches])
    assert _size_pvalue(sizes, n, q) > ALPHA
    assert _size_pvalue(sizes, n, q * 1.1) < ALPHA


def test_padding_mask_is_consistent(poisson_run):
    n, _, _, sampler, batches = poisson_run
    for batch in batches:
        assert isinstance(batch, SampledBatch)
        assert batch.indices.shape == batch.is_padding_example.shape == (sampler.padded_batch_size,)
        assert batch.indices.dtype == np.int32 and batch.is_padding_example.dtype == bool
        np.testing.assert_array_equal(batch.is_padding_example, batch.indices == -1)
        real = _real(batch)
        # Real examples first, then padding; no duplicates; all in range.
        assert not batch.is_padding_example[: real.size].any()
        assert np.unique(real).size == real.size
        assert real.min(initial=0) >= 0 and real.max(initial=0) < n
    assert sampler.num_truncated == 0


def test_default_padded_size_is_the_binomial_tail_quantile():
    n, expected = 1437, 256
    sampler = PoissonSampler(n, expected)
    q = expected / n
    size = sampler.padded_batch_size
    # Smallest size whose truncation probability (n + 1 examples) is <= 1e-12.
    assert stats.binom.sf(size, n + 1, q) <= 1e-12 < stats.binom.sf(size - 1, n + 1, q)
    assert sampler.truncation_probability == pytest.approx(stats.binom.sf(size, n + 1, q))
    assert sampler.sampling_prob == pytest.approx(q)
    assert sampler.poisson is True


@pytest.mark.parametrize("make", [PoissonSampler, ShuffledSampler])
def test_same_seed_same_batches_and_resume_mid_stream(make):
    kwargs = dict(sampling_prob=0.2) if make is PoissonSampler else dict(batch_size=17)
    first = make(100, **kwargs, seed=7)
    again = make(100, **kwargs, seed=7)
    other = make(100, **kwargs, seed=8)
    run_a, run_b, run_c = _draw(first, 30), _draw(again, 30), _draw(other, 30)
    for a, b in zip(run_a, run_b, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
    assert any(not np.array_equal(a.indices, c.indices) for a, c in zip(run_a, run_c, strict=True))

    # Checkpoint after 12 steps, through JSON, then resume in a fresh sampler.
    interrupted = make(100, **kwargs, seed=7)
    _draw(interrupted, 12)
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = make.from_state_dict(state)
    for want in run_a[12:]:
        got = next(resumed)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.is_padding_example, want.is_padding_example)
    # batch(step) is the same pure function of (seed, step).
    np.testing.assert_array_equal(resumed.batch(3).indices, run_a[3].indices)


@pytest.mark.parametrize("make", [PoissonSampler, ShuffledSampler])
def test_without_a_seed_the_sampling_is_secret(make):
    kwargs = dict(sampling_prob=0.2) if make is PoissonSampler else dict(batch_size=17)
    a, b = make(100, **kwargs), make(100, **kwargs)
    assert a.seed != b.seed and a.seed.bit_length() > 64  # 128 bits of OS entropy
    assert any(
        not np.array_equal(x.indices, y.indices)
        for x, y in zip(_draw(a, 10), _draw(b, 10), strict=True)
    )
    assert str(a.seed) not in repr(a)  # a repr may end up in a log
    resumed = make.from_state_dict(a.state_dict())  # the checkpoint keeps the seed
    np.testing.assert_array_equal(resumed.batch(4).indices, a.batch(4).indices)


def test_restore_refuses_a_different_configuration():
    state = PoissonSampler(100, sampling_prob=0.2, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PoissonSampler(100, sampling_prob=0.2, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffled"):
        ShuffledSampler(100, 10).load_state_dict(state)


def test_truncation_keeps_a_subset_and_is_counted():
    n, q, steps = 300, 0.1, 200
    # Untruncated reference: same seed, room for every sample.
    full = _draw(PoissonSampler(n, sampling_prob=q, padded_batch_size=n, seed=3), steps)
    small = PoissonSampler(n, sampling_prob=q, padded_batch_size=30, seed=3)
    cut = _draw(small, steps)
    sizes = np.array([_real(b).size for b in full])
    assert small.num_truncated == np.sum(sizes > 30) > 0
    assert small.num_dropped == np.sum(np.maximum(sizes - 30, 0))
    for f, c in zip(full, cut, strict=True):
        real_f, real_c = _real(f), _real(c)
        assert real_c.size == min(real_f.size, 30)
        assert set(real_c) <= set(real_f)
        if real_f.size <= 30:
            np.testing.assert_array_equal(real_c, real_f)
    assert small.state_dict()["num_truncated"] == small.num_truncated
    assert small.truncation_probability == pytest.approx(stats.binom.sf(30, n + 1, q))


def test_iteration_stops_after_num_steps():
    assert len(list(PoissonSampler(50, 5, num_steps=7))) == 7
    assert len(list(ShuffledSampler(50, 5, num_steps=4))) == 4


@pytest.mark.parametrize("n,batch_size", [(100, 10), (103, 10), (7, 7)])
def test_shuffled_sampler_covers_each_example_once_per_epoch(n, batch_size):
    sampler = ShuffledSampler(n, batch_size, seed=0)
    assert sampler.poisson is False
    assert "Poisson" in sampler.privacy_note and "not" in sampler.privacy_note
    per_epoch = -(-n // batch_size)
    assert sampler.steps_per_epoch == per_epoch
    epochs = []
    for _ in range(3):
        batches = _draw(sampler, per_epoch)
        real = np.concatenate([_real(b) for b in batches])
        np.testing.assert_array_equal(np.sort(real), np.arange(n))
        # Only the last batch of an epoch may hold padding.
        assert not any(b.is_padding_example.any() for b in batches[:-1])
        assert batches[-1].is_padding_example.sum() == per_epoch * batch_size - n
        epochs.append(real)
    if n > batch_size:
        assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        ((0, 5), {}, ValueError, "num_examples must be an integer >= 1"),
        ((100,), {}, ValueError, "exactly one of expected_batch_size and sampling_prob"),
        ((100, 5), {"sampling_prob": 0.1}, ValueError, "exactly one"),
        ((100, 200), {}, ValueError, r"expected_batch_size must be in \(0, num_examples=100\]"),
        ((100,), {"sampling_prob": 1.5}, ValueError, r"sampling_prob must be in \(0, 1\]"),
        ((100, 5), {"seed": -1}, ValueError, "seed must be an integer >= 0"),
        ((100, 5), {"padded_batch_size": 0}, ValueError, "padded_batch_size must be"),
        ((100, 5), {"padded_batch_size": 2.5}, TypeError, "padded_batch_size must be"),
    ],
)
def test_poisson_sampler_errors_name_the_field(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        PoissonSampler(*args, **kwargs)


def test_shuffled_sampler_errors_name_the_field():
    with pytest.raises(ValueError, match="batch_size must be <= num_examples=10"):
        ShuffledSampler(10, 11)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        ShuffledSampler(10, 0)
