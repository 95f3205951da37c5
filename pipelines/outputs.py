"""What a forward returns, and the parameters it reads: each request's own images split out
of a batch's, diffusers' outputs as 8-bit (or latent) arrays, and a resolved parameter."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from engine.request import RequestBatch, RequestOutput

_T = TypeVar("_T")


def split_outputs(
    batch: RequestBatch, images: list[np.ndarray], extras: dict[str, list[Any]] | None = None
) -> list[RequestOutput]:
    """Give each request its own n images (and extras, aligned with them), in batch order."""
    if len(images) != batch.num_images:
        raise RuntimeError(f"pipeline made {len(images)} images for a batch of {batch.num_images}")
    outputs: list[RequestOutput] = []
    start = 0
    for request in batch.requests:
        n = request.params.n
        outputs.append(
            RequestOutput(
                request_id=request.request_id,
                images=tuple(images[start : start + n]),
                seeds=tuple(request.params.image_seeds()),
                extras={name: values[start : start + n] for name, values in (extras or {}).items()},
            )
        )
        start += n
    return outputs


def resolved(value: _T | None) -> _T:
    """A parameter that `resolve` has filled in; None here is a bug, not bad input."""
    if value is None:
        raise RuntimeError("sampling parameters were not resolved before use")
    return value


def to_arrays(images: Any, output_type: str) -> list[np.ndarray]:
    if output_type == "latent":
        return [latent.float().cpu().numpy() for latent in images]
    # diffusers' "np" output is float in [0, 1]; round to the nearest 8-bit level.
    return [(np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8) for image in images]
