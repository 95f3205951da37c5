"""PSNR and SSIM: identical pictures, cases worked out by hand, and SSIM's windowed
statistics against the definition computed position by position."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.fidelity import gaussian_window, pooled_psnr, psnr, ssim, ssim_map

C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def flat(value: int, shape: tuple[int, ...] = (64, 64, 3)) -> np.ndarray:
    return np.full(shape, value, dtype=np.uint8)


def noise(seed: int, shape: tuple[int, ...] = (64, 64, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_identical_pictures_are_infinitely_close_and_fully_similar() -> None:
    image = noise(0)
    assert psnr(image, image.copy()) == math.inf
    assert ssim(image, image.copy()) == pytest.approx(1.0, abs=1e-12)


def test_psnr_of_known_errors() -> None:
    # Off by 10 everywhere: MSE 100, 10 log10(255^2 / 100) = 28.13 dB.
    assert psnr(flat(110), flat(100)) == pytest.approx(10 * math.log10(255**2 / 100))
    assert psnr(flat(255), flat(0)) == pytest.approx(0.0)
    # A set pools its squared errors: (0 + 100) / 2 = 50.
    assert pooled_psnr([flat(7), flat(110)], [flat(7), flat(100)]) == pytest.approx(
        10 * math.log10(255**2 / 50)
    )
    assert pooled_psnr([flat(7)], [flat(7)]) == math.inf


def test_ssim_of_two_flat_pictures_is_their_luminance_term() -> None:
    # No variance, no covariance: SSIM = (2 mu_x mu_y + C1) / (mu_x^2 + mu_y^2 + C1).
    expected = (2 * 100 * 150 + C1) / (100**2 + 150**2 + C1)
    assert ssim(flat(100), flat(150)) == pytest.approx(expected, rel=1e-12)
    # Black against white: C1 / (255^2 + C1), almost nothing alike.
    assert ssim(flat(0), flat(255)) == pytest.approx(C1 / (255**2 + C1), rel=1e-12)


def test_ssim_matches_its_definition_at_every_window_position() -> None:
    x, y = noise(1, (15, 13)).astype(np.float64), noise(2, (15, 13)).astype(np.float64)
    w = gaussian_window()
    assert w.size == 11 and w.sum() == pytest.approx(1.0)
    weights = np.outer(w, w)
    expected = np.empty((15 - 10, 13 - 10))
    for i in range(expected.shape[0]):
        for j in range(expected.shape[1]):
            a, b = x[i : i + 11, j : j + 11], y[i : i + 11, j : j + 11]
            mu_a, mu_b = (weights * a).sum(), (weights * b).sum()
            var_a = (weights * (a - mu_a) ** 2).sum()
            var_b = (weights * (b - mu_b) ** 2).sum()
            cov = (weights * (a - mu_a) * (b - mu_b)).sum()
            expected[i, j] = ((2 * mu_a * mu_b + C1) * (2 * cov + C2)) / (
                (mu_a**2 + mu_b**2 + C1) * (var_a + var_b + C2)
            )
    np.testing.assert_allclose(ssim_map(x, y), expected, rtol=1e-9, atol=1e-12)


def test_more_noise_is_less_similar_and_the_measures_are_symmetric() -> None:
    image = noise(3)
    rng = np.random.default_rng(4)
    slightly = np.clip(image + rng.normal(0, 4, image.shape), 0, 255).astype(np.uint8)
    badly = np.clip(image + rng.normal(0, 40, image.shape), 0, 255).astype(np.uint8)
    assert psnr(slightly, image) > psnr(badly, image) > psnr(noise(5), image)
    assert 1.0 > ssim(slightly, image) > ssim(badly, image) > ssim(noise(5), image)
    assert ssim(badly, image) == pytest.approx(ssim(image, badly))
    assert psnr(badly, image) == pytest.approx(psnr(image, badly))


def test_pictures_of_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        psnr(flat(0, (64, 64, 3)), flat(0, (32, 32, 3)))
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(flat(0, (8, 8, 3)), flat(0, (8, 8, 3)))
