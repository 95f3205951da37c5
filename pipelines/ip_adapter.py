"""IP-Adapters served beside a model (`--ip-adapter NAME=SOURCE`), batched step by step.

A request names the IP-Adapters it uses, each with a reference image and a scale
(`engine.request.IPAdapterRef`). They are loaded at start with diffusers' own
`load_ip_adapter` (all of a model's adapters in one call, so they share the first one's
CLIP image encoder, as diffusers does), then taken out of the UNet's forward: the image
projections are held here, and each cross-attention gets a `RowIPAttention` holding the
adapters' key and value projections. At prepare, a request's reference image is encoded
once by the pipeline's own `encode_image` (its negative rows get the zero or blank-image
embeddings diffusers gives them under classifier-free guidance); at each shared step the
rows that use an adapter get its image tokens at their own scale, the others none, so each
request's image is the one diffusers' pipeline of its task (`StableDiffusionPipeline`,
`StableDiffusionXLPipeline`, their img2img and inpainting pipelines) makes for it alone with
`ip_adapter_image=...` and `set_ip_adapter_scale(scale)`. The image tokens reach the UNet's
cross-attentions only, so SDXL's added text and size embeddings, and a task's latents, are
as without an adapter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.models.attention_processor import IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0
from diffusers.models.embeddings import ImageProjection
from PIL import Image
from torch import Tensor, nn

from engine.request import GenerationRequest, IPAdapterRef
from pipelines.ip_attention import ActiveRows, AdapterRows, RowIPAttention
from pipelines.stepping.state import DenoiseState
from pipelines.tiny.ip_adapter import WEIGHTS, is_tiny_ip_adapter, tiny_ip_adapter_dir


def reduced_references(request: GenerationRequest, extractors: Mapping[str, Any]) -> GenerationRequest:
    """`request` with each reference image resized and cropped as the image processor of its
    IP-Adapter (`extractors` by name: the pipeline's CLIP `feature_extractor`, a Redux prior's
    SigLIP one) does (its own code, without the float conversion), so a queued request holds
    no more; the processor later finds it at size and resizes nothing."""
    refs = []
    for ref in request.ip_adapters:
        pixels = extractors[ref.name](
            Image.fromarray(ref.image), do_rescale=False, do_normalize=False, return_tensors="np"
        ).pixel_values[0]
        image = np.ascontiguousarray(np.moveaxis(pixels, 0, -1).round().astype(np.uint8))
        refs.append(IPAdapterRef(ref.name, image, ref.scale))
    return replace(request, ip_adapters=tuple(refs))


def weights_location(source: str) -> tuple[str, str, str]:
    """`load_ip_adapter`'s (path or hub id, subfolder, weight name) for a SOURCE: the tiny
    one, a local weights file, or `owner/repo/<folder>/<file>` on the hub (h94/IP-Adapter's
    `models/ip-adapter_sd15.safetensors`). The image encoder is read from `image_encoder/`
    beside the weights, as in h94/IP-Adapter."""
    if is_tiny_ip_adapter(source):
        return str(tiny_ip_adapter_dir(source)), "", WEIGHTS
    path = Path(source)
    if path.is_file():
        return str(path.parent), "", path.name
    parts = source.split("/")
    if len(parts) < 3 or not parts[-1].endswith((".safetensors", ".bin")):
        raise ValueError(
            f"--ip-adapter {source}: name a weights file, local or on the hub as "
            "owner/repo/folder/file.safetensors (its image encoder in image_encoder/ beside it)"
        )
    return "/".join(parts[:2]), "/".join(parts[2:-1]), parts[-1]


class IPAdapters:
    """The IP-Adapters served beside one model, in load order."""

    def __init__(self, pipe: Any, names: tuple[str, ...], projections: nn.ModuleList, active: ActiveRows):
        self.pipe = pipe
        self.names = names
        self.projections = projections
        self.active = active

    @classmethod
    def load(cls, pipe: Any, sources: tuple[tuple[str, str], ...]) -> IPAdapters:
        unet = pipe.unet
        before = dict(unet.attn_processors)
        locations = [weights_location(source) for _, source in sources]
        pipe.load_ip_adapter(
            [path for path, _, _ in locations],
            subfolder=[folder for _, folder, _ in locations],
            weight_name=[weight for _, _, weight in locations],
        )
        projections = unet.encoder_hid_proj.image_projection_layers
        # Out of the UNet's forward, as diffusers' `unload_ip_adapter` leaves it: the image
        # tokens reach the processors per row (`RowIPAttention`), not through `added_cond_kwargs`.
        unet.encoder_hid_proj = None
        unet.config.encoder_hid_dim_type = None
        active = ActiveRows()
        unet.set_attn_processor(
            {
                name: _row_processor(before[name], loaded, active)
                for name, loaded in unet.attn_processors.items()
            }
        )
        return cls(pipe, tuple(name for name, _ in sources), projections, active)

    def embeds(self, state: DenoiseState) -> tuple[Tensor, ...]:
        """Each reference image's embeddings for the state's rows (its negative rows, then its
        positive rows), as `prepare_ip_adapter_image_embeds` lays them out for its call."""
        out = []
        for ref in state.request.ip_adapters:
            layer = self.projections[self.names.index(ref.name)]
            hidden = not isinstance(layer, ImageProjection)  # as diffusers decides per adapter
            image = Image.fromarray(ref.image)
            positive, negative = self.pipe.encode_image(image, state.latents.device, 1, hidden)
            n = state.num_images
            rows = [positive] * n if state.uncond is None else [negative] * n + [positive] * n
            out.append(torch.cat(rows)[:, None])
        return tuple(out)

    @contextmanager
    def applied(self, states: list[DenoiseState], dtype: torch.dtype) -> Iterator[None]:
        """The processors see the rows of `states` that use each adapter during the forward."""
        self.active.adapters = self._rows(states, dtype)
        try:
            yield
        finally:
            self.active.adapters = []

    def _rows(self, states: list[DenoiseState], dtype: torch.dtype) -> list[AdapterRows]:
        index: dict[int, list[int]] = {}
        embeds: dict[int, list[Tensor]] = {}
        scales: dict[int, list[float]] = {}
        offset = 0
        for state in states:
            for ref, embedded in zip(state.request.ip_adapters, state.ip_embeds, strict=True):
                adapter = self.names.index(ref.name)
                index.setdefault(adapter, []).extend(range(offset, offset + state.rows))
                embeds.setdefault(adapter, []).append(embedded)
                scales.setdefault(adapter, []).extend([ref.scale] * state.rows)
            offset += state.rows
        rows = []
        for adapter in sorted(index):  # load order: diffusers adds the adapters in that order
            device = embeds[adapter][0].device
            tokens = _projected(self.projections[adapter], torch.cat(embeds[adapter])).to(dtype)
            scale = torch.tensor(scales[adapter], dtype=dtype, device=device).view(-1, 1, 1)
            rows.append(AdapterRows(adapter, torch.tensor(index[adapter], device=device), tokens, scale))
        return rows


def _projected(layer: nn.Module, embeds: Tensor) -> Tensor:
    """`MultiIPAdapterImageProjection.forward` for one adapter: (rows, images, ...) in,
    (rows, images * tokens, dim) out, as the processor's key projection takes them."""
    rows, images = embeds.shape[0], embeds.shape[1]
    projected: Tensor = layer(embeds.reshape((rows * images, *embeds.shape[2:])))
    return projected.reshape((rows, images, *projected.shape[1:])).reshape(rows, -1, projected.shape[-1])


def _row_processor(before: Any, loaded: Any, active: ActiveRows) -> Any:
    """The processor for one attention: a `RowIPAttention` where diffusers put its IP-Adapter
    processor, else the one the UNet had."""
    if isinstance(loaded, IPAdapterAttnProcessor | IPAdapterAttnProcessor2_0):
        return RowIPAttention(before, loaded.to_k_ip, loaded.to_v_ip, active)
    return before
