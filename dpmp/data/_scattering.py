"""The 2-D scattering transform (Bruna and Mallat 2013) with kymatio's Morlet filters, in JAX.

For an image ``x`` padded by reflection to ``M x N`` (the next multiple of
``2^J`` above ``side + 2^J``), with Morlet wavelets ``psi_{j, theta}`` (``j <
J`` scales, ``L`` angles) and a Gaussian low-pass ``phi_J``::

    S0 x              = x * phi_J                                  1 channel
    S1 x [j1, t1]     = |x * psi_{j1, t1}| * phi_J                 J L channels
    S2 x [j1, t1, t2] = ||x * psi_{j1, t1}| * psi_{j2, t2}| * phi_J,  j1 < j2
                                                                   L^2 J (J - 1) / 2 channels

each subsampled by ``2^J`` and cut back to ``side / 2^J`` (the padding's
border dropped): for ``J = 2, L = 8`` that is ``1 + 16 + 64 = 81`` channels on
``7 x 7`` for a ``28 x 28`` image. Convolutions are products in the Fourier
domain, subsampling by ``k`` is the periodisation of the spectrum (the mean of
its ``k x k`` blocks), and the channel order is kymatio's (S0, then S1 by
``(j1, theta1)``, then S2 by ``(j1, theta1, j2, theta2)``), so that
consecutive groups of channels are the ones Tramer and Boneh's GroupNorm
groups. The filters are kymatio 0.3's (``kymatio.scattering2d.filter_bank``,
its constants included), so the features are the ones its NumPy frontend
computes, to float32 rounding (``tests/test_scattering.py`` compares them).

Privacy: the transform is a fixed function of one image alone; it reads no
other record and no statistic of the data. Applied to every record before
training, it is a per-record preprocessing of the data set: DP-SGD on the
features is DP-SGD on a fixed function of each record, so the guarantee for
the features is the guarantee for the images, at no cost in epsilon.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["Scattering2D"]


class Scattering2D:
    """The scattering transform of square or rectangular grey or colour images.

    Args:
      J: the number of scales; the output is subsampled by ``2^J``.
      L: the number of angles.
      shape: ``(h, w)`` of the images; both divisible by ``2^J``.

    Example:
      >>> s = Scattering2D(J=2, L=8, shape=(28, 28))
      >>> s.channels, s.output_shape(1)
      (81, (7, 7, 81))
    """

    def __init__(self, *, J: int = 2, L: int = 8, shape: tuple[int, int] = (28, 28)):
        h, w = shape
        if J < 1 or L < 1 or h % 2**J or w % 2**J:
            raise ValueError(
                f"scattering: J = {J} and L = {L} must be >= 1 and the image sides {h}x{w} "
                f"divisible by 2^J = {2**J}"
            )
        self.J, self.L, self.shape = J, L, (h, w)
        self.channels = 1 + J * L + L * L * J * (J - 1) // 2

    def output_shape(self, colours: int) -> tuple[int, int, int]:
        """``(h / 2^J, w / 2^J, channels * colours)``: one image's features."""
        h, w = self.shape
        return (h // 2**self.J, w // 2**self.J, self.channels * colours)

    def __call__(self, x):
        """The features of images ``x`` ``[n, h, w, c]``: float32 ``[n, h/2^J, w/2^J, 81 c]``
        (``J = 2, L = 8``), each colour's channels together (colour-major, as the paper's
        ``view(-1, 81 c, h, w)`` of kymatio's output). A jax array; jitted."""
        return _transform(self.J, self.L, self.shape)(x)


@functools.cache
def _transform(J: int, L: int, shape: tuple[int, int]):
    """The jitted transform of ``[n, h, w, c]`` images for these settings."""
    import jax
    import jax.numpy as jnp

    h, w = shape
    M, N = (_padded(side, J) for side in shape)
    phi, psi = _filter_bank(M, N, J, L)
    phi = [jnp.asarray(f, jnp.float32) for f in phi]
    psi = [[jnp.asarray(f, jnp.float32) for f in levels] for levels in psi]
    top, left = (M - h) // 2, (N - w) // 2

    def periodize(x, k):  # subsampling by k in space: the mean of the spectrum's k x k blocks
        if k == 1:
            return x
        m, n = x.shape[-2] // k, x.shape[-1] // k
        return x.reshape(*x.shape[:-2], k, m, k, n).mean(axis=(-4, -2))

    def low_pass(u_hat, level, k):  # (u * phi) subsampled by k, in space, border dropped
        s = jnp.fft.ifft2(periodize(u_hat * phi[level], k)).real
        return s[..., 1:-1, 1:-1]

    def modulus(u_hat, k):  # |u subsampled by k|, back in the Fourier domain
        u = jnp.abs(jnp.fft.ifft2(periodize(u_hat, k)))
        return jnp.fft.fft2(u.astype(jnp.complex64))

    def one(x):  # [b, h, w] -> [b, channels, h / 2^J, w / 2^J]
        b = x.shape[0]
        padded = jnp.pad(x, ((0, 0), (top, M - h - top), (left, N - w - left)), mode="reflect")
        u0 = jnp.fft.fft2(padded.astype(jnp.complex64))
        first, second = [low_pass(u0[:, None], 0, 2**J)], []
        for j1 in range(J):
            u1 = modulus(u0[:, None] * psi[j1][0], 2**j1)  # [b, L, ...]: theta1
            first.append(low_pass(u1, j1, 2 ** (J - j1)))
            paths = [  # [b, L, L, ...]: theta1, theta2
                low_pass(modulus(u1[:, :, None] * psi[j2][j1], 2 ** (j2 - j1)), j2, 2 ** (J - j2))
                for j2 in range(j1 + 1, J)
            ]
            if paths:  # by theta1, then j2, then theta2
                second.append(jnp.concatenate(paths, axis=2).reshape(b, -1, *paths[0].shape[3:]))
        return jnp.concatenate(first + second, axis=1)

    @jax.jit
    def transform(x):
        n, _, _, c = x.shape
        grey = jnp.moveaxis(x.astype(jnp.float32), -1, 1).reshape(n * c, h, w)
        s = one(grey)  # [n c, K, h', w']
        s = s.reshape(n, c * s.shape[1], *s.shape[2:])
        return jnp.moveaxis(s, 1, -1)

    return transform


def _padded(side: int, J: int) -> int:
    """kymatio's padded size: the multiple of ``2^J`` after ``side + 2^J``."""
    return ((side + 2**J) // 2**J + 1) * 2**J


def _filter_bank(M: int, N: int, J: int, L: int):
    """kymatio 0.3's filters in the Fourier domain, float64: ``(phi, psi)`` where
    ``phi[res]`` is the low-pass at resolution ``2^-res`` (``M / 2^res x N / 2^res``,
    ``res < J``) and ``psi[j][res]`` the ``L`` wavelets of scale ``j`` by angle,
    ``[L, M / 2^res, N / 2^res]``, for ``res < min(j + 1, max(J - 1, 1))``."""
    psi = []
    for j in range(J):
        hats = []
        for theta in range(L):
            angle = (int(L - L / 2 - 1) - theta) * math.pi / L
            spatial = _morlet(M, N, 0.8 * 2**j, angle, 3.0 / 4.0 * math.pi / 2**j, 4.0 / L)
            hats.append(np.fft.fft2(spatial).real)  # its imaginary part is zero
        levels = range(min(j + 1, max(J - 1, 1)))
        psi.append([np.stack([_periodize(hat, res) for hat in hats]) for res in levels])
    phi_hat = np.fft.fft2(_gabor(M, N, 0.8 * 2 ** (J - 1), 0.0, 0.0, 1.0)).real
    return [_periodize(phi_hat, res) for res in range(J)], psi


def _periodize(x: np.ndarray, res: int) -> np.ndarray:
    """A filter's spectrum for an image subsampled by ``2^res``: the frequencies
    above the new band limit zeroed, then folded onto ``M / 2^res x N / 2^res``."""
    M, N = x.shape
    k = 2**res
    mask = np.ones(x.shape)
    start_x, len_x = int(M * 2 ** (-res - 1)), int(M * (1 - 2 ** (-res)))
    start_y, len_y = int(N * 2 ** (-res - 1)), int(N * (1 - 2 ** (-res)))
    mask[start_x : start_x + len_x, :] = 0
    mask[:, start_y : start_y + len_y] = 0
    return (x * mask).reshape(k, M // k, k, N // k).sum(axis=(0, 2))


def _morlet(M: int, N: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Morlet wavelet: a Gabor filter minus the Gaussian that makes its mean zero."""
    wave = _gabor(M, N, sigma, theta, xi, slant)
    envelope = _gabor(M, N, sigma, theta, 0.0, slant)
    return wave - wave.sum() / envelope.sum() * envelope


def _gabor(M: int, N: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """``g_sigma(u) exp(i xi <u, (cos theta, sin theta)>)`` on the ``M x N`` grid,
    periodised over the 5 x 5 neighbouring copies, complex128."""
    c, s = math.cos(theta), math.sin(theta)
    rotation = np.array([[c, -s], [s, c]])
    curvature = rotation @ np.diag([1.0, slant * slant]) @ rotation.T / (2 * sigma * sigma)
    out = np.zeros((M, N), np.complex128)
    for ex in range(-2, 3):
        for ey in range(-2, 3):
            xx, yy = np.mgrid[ex * M : M + ex * M, ey * N : N + ey * N].astype(np.float64)
            quadratic = (
                curvature[0, 0] * xx * xx
                + (curvature[0, 1] + curvature[1, 0]) * xx * yy
                + curvature[1, 1] * yy * yy
            )
            out += np.exp(-quadratic + 1j * xi * (xx * c + yy * s))
    # kymatio's normalisation, 3.1415 as it writes it (the filters are its filters)
    return out / (2 * 3.1415 * sigma * sigma / slant)
