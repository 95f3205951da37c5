"""Setting a request up for step-level batching: what a family's `_encode` and `_prepare`
hooks share. Every joiner's prompt goes through the text encoders in one call; each request
gets generators of its own (its seeds) and a copy of the pipeline's scheduler with its own
timesteps, so it denoises as the stock pipeline would for it alone.

The packed flow-matching families (FLUX, Qwen-Image) also share their latent size, schedule
and inpainting mask here, and the flow-matching img2img pipelines' step count
(`flow_skipped_steps`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning, Encoded


def generators_for(request: GenerationRequest) -> list[torch.Generator]:
    """One CPU generator per image (seed, seed+1, ...), as in request mode: the same noise on
    every device, so a seed reproduces an image across machines."""
    return [torch.Generator("cpu").manual_seed(seed) for seed in request.params.image_seeds()]


def guidance_rows(embeds: torch.Tensor, scale: float) -> torch.Tensor:
    """A distilled-guidance input (FLUX.1-dev, guidance-distilled Qwen-Image): one per row."""
    return torch.full((embeds.shape[0],), scale, dtype=torch.float32, device=embeds.device)


def own_scheduler(
    template: Any, num_inference_steps: int | None, device: torch.device | str, **kwargs: Any
) -> Any:
    """A copy of the pipeline's scheduler with this request's timesteps set (~0.2 ms), as
    diffusers' `retrieve_timesteps` sets them (flow models pass `sigmas` and `mu` instead
    of a step count)."""
    scheduler = copy.deepcopy(template)
    if num_inference_steps is None:
        scheduler.set_timesteps(device=device, **kwargs)
    else:
        scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    return scheduler


# Text encoding for all joiners: (texts, the request of each text) -> tensors with one row
# per text. Most families need only the texts; an edit also encodes each request's image.
EncodeTexts = Callable[[list[str], list[GenerationRequest]], tuple[torch.Tensor, ...]]
# (request, its rows of each encoded tensor) -> its conditioning.
ToConditioning = Callable[[GenerationRequest, tuple[torch.Tensor, ...]], Conditioning]


def encode_together(
    requests: list[GenerationRequest],
    uses_cfg: Callable[[GenerationRequest], bool],
    encode: EncodeTexts,
    to_conditioning: ToConditioning,
) -> list[Encoded]:
    """Every joiner's prompt (n rows each) and, for those that `uses_cfg`, its negative
    prompt ("" when none), through the text encoders in ONE call; then each request's rows."""
    guided = [r for r in requests if uses_cfg(r)]
    texts = [r.prompt for r in requests for _ in range(r.params.n)]
    texts += [r.params.negative_prompt or "" for r in guided for _ in range(r.params.n)]
    owners = [r for r in [*requests, *guided] for _ in range(r.params.n)]
    sizes = [r.params.n for r in [*requests, *guided]]
    rows = iter(zip(*(torch.split(tensor, sizes) for tensor in encode(texts, owners)), strict=True))
    positive = [to_conditioning(r, next(rows)) for r in requests]
    guided_ids = {r.request_id for r in guided}
    return [
        (cond, to_conditioning(r, next(rows)) if r.request_id in guided_ids else None)
        for r, cond in zip(requests, positive, strict=True)
    ]


def flow_scheduler(
    template: Any,
    steps: int,
    image_seq_len: int,
    device: torch.device | str,
    *,
    linear_sigmas: bool = True,
    max_shift: float = 1.15,
    mu: float | None = None,
    sigmas: list[float] | None = None,
) -> Any:
    """A request's own flow-matching schedule, as FLUX, Qwen-Image and SD3 set theirs: sigmas
    1 → 1/steps with `linear_sigmas` (else the scheduler's own for the step count; or the
    model's own `sigmas`, Qwen-Image 2.1's `sample_sigmas`), shifted by `mu` from the image's
    token count where the scheduler shifts dynamically (or by the family's own `mu`, passed
    as its pipeline passes it: FLUX.2's depends on the steps too); the step index starts at 0."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = template.config
    kwargs: dict[str, Any] = {}
    if mu is not None:
        kwargs["mu"] = mu
    elif config.get("use_dynamic_shifting", None):
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )
    if sigmas is not None:
        scheduler = own_scheduler(template, None, device, sigmas=sigmas, **kwargs)
    elif linear_sigmas:
        scheduler = own_scheduler(template, None, device, sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)
    else:
        scheduler = own_scheduler(template, steps, device, **kwargs)
    scheduler.set_begin_index(0)
    return scheduler


def packed_size(pipe: Any, request: GenerationRequest) -> tuple[int, int]:
    """(height, width) of a request's latents before they are packed in 2x2 patches (a
    token covers 2 * `vae_scale_factor` pixels a side), as FLUX and Qwen-Image size them."""
    params, side = request.params, pipe.vae_scale_factor * 2
    return 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)


def packed_flow_scheduler(
    pipe: Any, request: GenerationRequest, device: torch.device, *, linear_sigmas: bool = True
) -> Any:
    """The request's own flow-matching schedule for a family with packed latents (FLUX,
    Qwen-Image), `mu` from its image's token count."""
    height, width = packed_size(pipe, request)
    tokens = (height // 2) * (width // 2)
    steps = resolved(request.params.num_inference_steps)
    return flow_scheduler(pipe.scheduler, steps, tokens, device, linear_sigmas=linear_sigmas)


def packed_mask(
    pipe: Any, request: GenerationRequest, condition: Tensor, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """The mask at latent size, packed as the latents are (1 = repaint), one row per image,
    as the FLUX and Qwen-Image inpainting pipelines' `prepare_mask_latents`."""
    height, width = packed_size(pipe, request)
    channels = pipe.transformer.config.in_channels // 4
    mask = F.interpolate(condition, size=(height, width))
    mask = mask.to(device, dtype).repeat(1, channels, 1, 1)
    packed: Tensor = pipe._pack_latents(mask, request.params.n, channels, height, width)
    return packed


def flow_skipped_steps(steps: int, strength: float) -> int:
    """The steps a request skips in the flow-matching img2img pipelines (FLUX, Qwen-Image):
    their `get_timesteps` rounds the skipped steps down, where Stable Diffusion's rounds the
    redrawn steps down."""
    return int(max(steps - min(steps * strength, steps), 0))
