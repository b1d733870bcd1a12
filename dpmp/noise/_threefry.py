"""Threefry block functions written out as elementwise uint32 arithmetic.

Threefry (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy
as 1, 2, 3"; the Random123 library) maps a key and a counter to random words
by rounds of add-rotate-xor, Threefish's structure without its tweak:

    threefry2x32   64-bit key, 64-bit counter,  64 bits out   (JAX's default keys)
    threefry4x32  128-bit key, 128-bit counter, 128 bits out  (dpmp's secret keys)

Both run 20 rounds with Random123's rotation constants and key schedule (a
parity word ``0x1BD11BDA`` xored with the key words; a key word injection and
the injection's index every 4 rounds). Written out, XLA fuses the rounds with
whatever consumes the words into one pass; that is how the noise is drawn.
For the few words of a key (split, fold_in, a table of leaf keys) the rounds
are a loop instead (``threefry4x32_rolled``), as JAX lowers its own primitive on
XLA:CPU (``jax/_src/random/threefry2x32.py``): written out, a block whose four
words are used apart is emitted once per word, and XLA:CPU took 5 s to compile
a step's key split alone (2 CPU cores; 1 s rolled). Each function
equals Random123's known-answer vectors (``tests/kat_vectors``), and the 2x32
one JAX's ``threefry2x32`` primitive bit for bit (tests/test_threefry.py).

Why 4x32 for secrets: a 64-bit key can be searched. A coordinate whose clipped
sum is known (zero: a token that no private record holds, a padding row) shows
its noise, and a guess of the key can be tested against it: about ``2^64``
block evaluations, below the ``2^128`` margin keys are usually held to. The
4x32 block takes a 128-bit key and gives the 128 bits a snapped coordinate
needs in one call, at the cost of two 2x32 calls.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PARITY", "threefry2x32", "threefry4x32", "threefry4x32_rolled"]

PARITY = np.uint32(0x1BD11BDA)

_ROTATIONS_2X32 = ((13, 15, 26, 6), (17, 29, 16, 24))
# Random123's R_32x4: rotation (of word 1, of word 3) in rounds 0 to 7, repeated.
_ROTATIONS_4X32 = ((10, 26), (11, 21), (13, 27), (23, 5), (6, 20), (17, 11), (25, 10), (18, 20))


def _rotl(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32, 20 rounds: key ``(k0, k1)``, counters ``(x0, x1)`` (uint32,
    broadcasting); two uint32 words of the counters' shape."""
    ks = (k0, k1, k0 ^ k1 ^ PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS_2X32[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotl(x1, r)
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def threefry4x32(key, counter, rounds: int = 20):
    """Threefry-4x32: ``key`` and ``counter`` are 4-tuples of uint32 values
    (broadcasting); four uint32 words of the counters' shape.

    Even rounds mix the pairs (0, 1) and (2, 3), odd rounds (0, 3) and (2, 1)::

        x0 += x1; x1 = rotl(x1, R[r][0]) ^ x0; x2 += x3; x3 = rotl(x3, R[r][1]) ^ x2
        x0 += x3; x3 = rotl(x3, R[r][0]) ^ x0; x2 += x1; x1 = rotl(x1, R[r][1]) ^ x2

    and after rounds 4s - 1 the key words ``ks[(s + j) % 5]`` and ``s`` are added
    (``ks[4]`` is the parity word).
    """
    k = tuple(key)
    ks = (*k, k[0] ^ k[1] ^ k[2] ^ k[3] ^ PARITY)
    x = [c + ks[j] for j, c in enumerate(counter)]
    for r in range(rounds):
        a, b = _ROTATIONS_4X32[r % 8]
        if r % 2 == 0:
            x[0] = x[0] + x[1]
            x[1] = _rotl(x[1], a) ^ x[0]
            x[2] = x[2] + x[3]
            x[3] = _rotl(x[3], b) ^ x[2]
        else:
            x[0] = x[0] + x[3]
            x[3] = _rotl(x[3], a) ^ x[0]
            x[2] = x[2] + x[1]
            x[1] = _rotl(x[1], b) ^ x[2]
        if r % 4 == 3:
            s = (r + 1) // 4
            x = [w + ks[(s + j) % 5] for j, w in enumerate(x)]
            x[3] = x[3] + np.uint32(s)
    return tuple(x)


def _round_pair(x: list, rotation, r4: int) -> list:
    """Round ``4s + r4`` of ``threefry4x32`` (its pairs fixed by ``r4``'s parity),
    the rotations ``rotation`` (2 values) read from the loop's carry."""
    x = list(x)
    first, second = (1, 3) if r4 % 2 == 0 else (3, 1)
    x[0] = x[0] + x[first]
    x[first] = _rotl_by(x[first], rotation[0]) ^ x[0]
    x[2] = x[2] + x[second]
    x[second] = _rotl_by(x[second], rotation[1]) ^ x[2]
    return x


def _rotl_by(x, r):
    """``_rotl`` by a traced amount (uint32)."""
    return (x << r) | (x >> (np.uint32(32) - r))


def threefry4x32_rolled(key, counter):
    """``threefry4x32`` with 20 rounds as a loop of 5 groups of 4 rounds (the same
    words): a small program for the few blocks of a key's split or fold_in,
    where the written-out rounds cost seconds of compile time and save
    nothing."""
    import jax
    import jax.numpy as jnp

    k = tuple(key)
    ks = [*k, k[0] ^ k[1] ^ k[2] ^ k[3] ^ PARITY]
    x = [c + ks[j] for j, c in enumerate(counter)]
    x = [jnp.asarray(w, jnp.uint32) for w in jnp.broadcast_arrays(*x)]
    rotations = [
        jnp.asarray(_ROTATIONS_4X32[:4], jnp.uint32),
        jnp.asarray(_ROTATIONS_4X32[4:], jnp.uint32),
    ]

    def group(s, carry):
        # The carry's ks[i] is the schedule's ks[(s + i) % 5], its rotations[0] the
        # group's (Random123's R_32x4 rows 4 (s % 2) to 4 (s % 2) + 3).
        x, ks, rotations = carry
        for r4 in range(4):
            x = _round_pair(x, rotations[0][r4], r4)
        x = [w + ks[1 + j] for j, w in enumerate(x)]  # ks[(s + 1 + j) % 5]
        x[3] = x[3] + (s + 1).astype(jnp.uint32)
        return x, ks[1:] + ks[:1], rotations[1:] + rotations[:1]

    ks = [jnp.broadcast_to(jnp.asarray(w, jnp.uint32), x[0].shape) for w in ks]
    out, _, _ = jax.lax.fori_loop(0, 5, group, (x, ks, rotations))
    return tuple(out)
