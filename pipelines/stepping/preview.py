"""Previews (`partial_images`): what the latents will become, and a decoder that costs
next to nothing.

`clean_estimate` is the scheduler's current estimate of the finished latents, which a
preview decodes.

Decoding a preview with the model's VAE costs as much as decoding the final image, once
per preview (`partial_images` up to 3): on the tiny models that is 20% of the throughput
of a closed loop whose requests all preview (docs/benchmarks.md). The cheap alternative is
the "latent to RGB" projection image UIs use for live previews: each latent pixel's
channels times a small matrix give the colour of the image patch it stands for. Rather
than ship per-model factors (or download a tiny VAE), `LinearPreview` fits the matrix by
least squares on this server's own final decodes: every finished image pairs its latents
with what the VAE made of them, so the fit needs no extra decode, follows any VAE and
sharpens as the server works. Until it has seen `MIN_IMAGES` images, previews go through
the VAE.

Observing a decode is not free, though: its full-size images are copied to the CPU and
pooled. So the fit learns only from the final images of requests that asked for previews
(a server whose clients never preview never fits), on a thread of its own
(`observe_later`), skipping a decode while the last is still being fitted, so a busy
server samples its decodes instead of queueing work behind them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling

logger = logging.getLogger(__name__)


def clean_estimate(
    scheduler: Any,
    sample: torch.Tensor,
    prediction: torch.Tensor,
    *,
    t: torch.Tensor,
    index: int,
    stepped: Any,
) -> torch.Tensor:
    """The scheduler's estimate of the finished latents at step `index` (what a preview shows):
    its own `pred_original_sample` where its step returns one (DDIM, Euler, LCM), else from
    the prediction: x - sigma*v for flow matching; (x - sqrt(1-a)*eps) / sqrt(a) for
    epsilon-prediction and sqrt(a)*x - sqrt(1-a)*v for v-prediction in variance-preserving
    schedulers (DPM-Solver, UniPC, PNDM), a = alphas_cumprod[t]. Anything else previews the
    noisy latents themselves."""
    if len(stepped) > 1 and isinstance(stepped[1], torch.Tensor):
        own: torch.Tensor = stepped[1]
        return own
    config = scheduler.config
    kind = config.get("prediction_type", None)
    if kind == "flow_prediction" or "FlowMatch" in type(scheduler).__name__:
        sigma: torch.Tensor = scheduler.sigmas[index].to(sample.device)
        return (sample.float() - sigma * prediction.float()).to(sample.dtype)
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if alphas is None or float(getattr(scheduler, "init_noise_sigma", 1.0)) != 1.0:
        return sample
    alpha: torch.Tensor = alphas[int(t)].to(sample.device, torch.float32)
    x, out = sample.float(), prediction.float()
    if kind == "epsilon":
        estimate = (x - (1 - alpha).sqrt() * out) / alpha.sqrt()
    elif kind == "v_prediction":
        estimate = alpha.sqrt() * x - (1 - alpha).sqrt() * out
    elif kind == "sample":
        estimate = out
    else:
        return sample
    return estimate.to(sample.dtype)


# Images seen before the fit is trusted: a few images hold thousands of (latent pixel, RGB)
# pairs, far more than the (channels + 1) x 3 unknowns.
MIN_IMAGES = 4
# Ridge term relative to the mean diagonal, so a rarely used channel cannot blow up.
_RIDGE = 1e-4


class LinearPreview:
    """Thread-safe: final images are observed on the fit's thread while previews are decoded
    on the stepping thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._xtx: torch.Tensor | None = None
        self._xty: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self.images_seen = 0
        # The fit's own thread (made on first use) and the observation it is working on.
        self._fitter: ThreadPoolExecutor | None = None
        self._fitting: Future[None] | None = None

    @property
    def ready(self) -> bool:
        return self.images_seen >= MIN_IMAGES

    def observe_later(self, grid: torch.Tensor, images: np.ndarray) -> bool:
        """`observe` on the fit's own thread, so the caller (a thread that steps or decodes)
        does not wait for it; skipped (False) while the last observation is still being
        fitted. The caller must not change `grid` or `images` afterwards."""
        with self._lock:
            if self._fitting is not None and not self._fitting.done():
                return False
            if self._fitter is None:
                self._fitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffbatch-preview-fit")
            self._fitting = self._fitter.submit(self._observe_quietly, grid, images)
            return True

    def wait(self) -> None:
        """Until the observation being fitted (if any) is done."""
        fitting = self._fitting
        if fitting is not None:
            fitting.result()

    def _observe_quietly(self, grid: torch.Tensor, images: np.ndarray) -> None:
        try:
            with torch.inference_mode():
                self.observe(grid, images)
        except Exception:  # a preview aid: its failure must not reach any request
            logger.warning("the linear preview could not learn from a decode", exc_info=True)

    def observe(self, grid: torch.Tensor, images: np.ndarray) -> None:
        """Learn from decoded images: `grid` (B, C, h, w) latents, `images` (B, H, W, 3) floats
        in [0, 1] whose H and W are whole multiples of h and w."""
        # Pooled in float32 (an average of values in [0, 1] loses nothing there): the
        # full-size images are the bulk of the work; the small sums below are float64.
        rgb = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).to(torch.float32)
        # Each latent pixel's patch of the image, averaged to one colour.
        pooled = F.adaptive_avg_pool2d(rgb, (int(grid.shape[-2]), int(grid.shape[-1])))
        x = _features(grid)
        y = pooled.permute(0, 2, 3, 1).reshape(-1, 3).to(torch.float64)
        xtx, xty = x.T @ x, x.T @ y
        with self._lock:
            if self._xtx is None or self._xty is None or self._xtx.shape != xtx.shape:
                self._xtx, self._xty, self.images_seen = xtx, xty, 0
            else:
                self._xtx = self._xtx + xtx
                self._xty = self._xty + xty
            self.images_seen += grid.shape[0]
            self._weights = None

    def decode(self, grid: torch.Tensor, height: int, width: int) -> list[np.ndarray]:
        """uint8 HxWx3 previews of `grid` (B, C, h, w), each latent pixel a flat patch."""
        weights = self._solve()
        rgb = (_features(grid) @ weights).reshape(grid.shape[0], *grid.shape[-2:], 3).permute(0, 3, 1, 2)
        rgb = F.interpolate(rgb.clamp(0, 1).float(), size=(height, width), mode="nearest")
        images = (rgb.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()
        return list(images)

    def _solve(self) -> torch.Tensor:
        with self._lock:
            if self._weights is None:
                xtx, xty = self._xtx, self._xty
                if xtx is None or xty is None:
                    raise RuntimeError("LinearPreview has seen no images yet")
                ridge = _RIDGE * xtx.diagonal().mean() * torch.eye(xtx.shape[0], dtype=torch.float64)
                self._weights = torch.linalg.solve(xtx + ridge, xty)
            return self._weights


def _features(grid: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> one row per latent pixel: its C channels and a 1 for the bias."""
    rows = grid.detach().to("cpu", torch.float64).permute(0, 2, 3, 1).reshape(-1, grid.shape[1])
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=torch.float64)], dim=1)
