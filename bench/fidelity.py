"""How close a picture is to a reference picture of the same request: PSNR and SSIM.

Pure numpy, on uint8 (or 0-255 float) RGB arrays of the same shape. SSIM is Wang et al.
(2004) as scikit-image computes it with `gaussian_weights=True, sigma=1.5,
use_sample_covariance=False, data_range=255, channel_axis=-1`: local statistics under an
11x11 Gaussian window (sigma 1.5) at every position where the window fits inside the
picture, averaged over those positions and over the channels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PEAK = 255.0
_SIGMA = 1.5
_RADIUS = int(3.5 * _SIGMA + 0.5)  # scikit-image's truncation: an 11-pixel window
_K1, _K2 = 0.01, 0.03


def mse(image: np.ndarray, reference: np.ndarray) -> float:
    _same_shape(image, reference)
    difference = image.astype(np.float64) - reference.astype(np.float64)
    return float(np.mean(difference**2))


def psnr_of_mse(error: float, peak: float = PEAK) -> float:
    """Peak signal-to-noise ratio in dB of a mean squared error; inf when it is 0."""
    return float("inf") if error == 0 else float(10 * np.log10(peak**2 / error))


def psnr(image: np.ndarray, reference: np.ndarray, peak: float = PEAK) -> float:
    return psnr_of_mse(mse(image, reference), peak)


def pooled_psnr(images: Sequence[np.ndarray], references: Sequence[np.ndarray]) -> float:
    """PSNR of a set: of the mean squared error over every pixel of every pair (pictures of
    one size), so one identical pair does not make the whole set infinite."""
    if not images:
        raise ValueError("pooled_psnr needs at least one pair")
    errors = [mse(image, reference) for image, reference in zip(images, references, strict=True)]
    return psnr_of_mse(float(np.mean(errors)))


def gaussian_window() -> np.ndarray:
    offsets = np.arange(-_RADIUS, _RADIUS + 1, dtype=np.float64)
    weights = np.exp(-(offsets**2) / (2 * _SIGMA**2))
    normalised: np.ndarray = weights / weights.sum()
    return normalised


def _filter(plane: np.ndarray, window: np.ndarray) -> np.ndarray:
    """`plane` smoothed by the separable `window` where it fits entirely ("valid")."""
    height, width = plane.shape[0] - window.size + 1, plane.shape[1] - window.size + 1
    rows = np.zeros((height, plane.shape[1]))
    for k, weight in enumerate(window):
        rows += weight * plane[k : k + height]
    smoothed = np.zeros((height, width))
    for k, weight in enumerate(window):
        smoothed += weight * rows[:, k : k + width]
    return smoothed


def ssim_map(image: np.ndarray, reference: np.ndarray, peak: float = PEAK) -> np.ndarray:
    """SSIM at each window position of one channel (2-D arrays)."""
    window = gaussian_window()
    if min(image.shape) < window.size:
        raise ValueError(f"SSIM needs pictures of at least {window.size}x{window.size}, got {image.shape}")
    x, y = image.astype(np.float64), reference.astype(np.float64)
    mu_x, mu_y = _filter(x, window), _filter(y, window)
    var_x = _filter(x * x, window) - mu_x**2
    var_y = _filter(y * y, window) - mu_y**2
    cov = _filter(x * y, window) - mu_x * mu_y
    c1, c2 = (_K1 * peak) ** 2, (_K2 * peak) ** 2
    structure: np.ndarray = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    )
    return structure


def ssim(image: np.ndarray, reference: np.ndarray, peak: float = PEAK) -> float:
    """Mean SSIM over window positions and channels (HxW or HxWxC): 1.0 for identical pictures."""
    _same_shape(image, reference)
    if image.ndim == 2:
        return float(ssim_map(image, reference, peak).mean())
    channels = range(image.shape[-1])
    return float(np.mean([ssim_map(image[..., c], reference[..., c], peak).mean() for c in channels]))


def _same_shape(image: np.ndarray, reference: np.ndarray) -> None:
    if image.shape != reference.shape:
        raise ValueError(f"pictures differ in shape: {image.shape} and {reference.shape}")
