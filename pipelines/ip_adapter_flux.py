"""FLUX.1's IP-Adapters (XLabs-AI/flux-ip-adapter's layout) served beside a FLUX.1 model
(text-to-image, image-to-image, inpainting), batched step by step as `pipelines.ip_adapter`
batches the UNets'.

diffusers' `FluxIPAdapterAttnProcessor` runs in each double-stream block: the block's joint
attention as without an adapter, plus `scale * attention(image query, image tokens)` returned
as a third output, which the block adds to its image stream after the feed-forward; one scale
per adapter for the whole call. `RowFluxIPAttention` keeps diffusers' key and value
projections and makes that third output per row: each row's own scale for the rows that use
an adapter, zeros for the others (which the block adds without changing a bit); with no row
in use it is the processor the transformer had, returning what it returned.

As `FluxPipeline(ip_adapter_image=...)`: a request's reference image is encoded once at
prepare by the pipeline's own `encode_image` (the CLIP image embedding, projected to 4 tokens
by the adapter's `ImageProjection` at each step); under true CFG its negative rows get a
black image's embedding at the same scale (diffusers' `negative_ip_adapter_image` default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
from PIL import Image
from torch import Tensor

from pipelines.ip_adapter import IPAdapters, weights_location
from pipelines.ip_attention import ActiveRows, AdapterRows, RowIPProcessor
from pipelines.outputs import resolved
from pipelines.stepping.state import DenoiseState

# XLabs-AI/flux-ip-adapter's image encoder, where no `image_encoder/` lies beside the weights.
FLUX_IMAGE_ENCODER = "openai/clip-vit-large-patch14"


def image_encoder_location(source: str) -> str:
    """The CLIP image encoder `load_ip_adapter` reads for a FLUX IP-Adapter: `image_encoder/`
    beside a local weights file (the tiny one's), else XLabs' published encoder."""
    path, folder, _ = weights_location(source)
    beside = Path(path) / folder / "image_encoder"
    return str(beside) if beside.is_dir() else FLUX_IMAGE_ENCODER


class FluxIPAdapters(IPAdapters):
    """The IP-Adapters served beside one FLUX.1 model, in load order."""

    @classmethod
    def load(cls, pipe: Any, sources: tuple[tuple[str, str], ...]) -> FluxIPAdapters:
        transformer = pipe.transformer
        before = dict(transformer.attn_processors)
        locations = [weights_location(source) for _, source in sources]
        # All in one call: they share the first one's image encoder, as diffusers does.
        pipe.load_ip_adapter(
            [path for path, _, _ in locations],
            subfolder=[folder for _, folder, _ in locations],
            weight_name=[weight for _, _, weight in locations],
            image_encoder_pretrained_model_name_or_path=image_encoder_location(sources[0][1]),
            image_encoder_dtype=transformer.dtype,
        )
        # The projections stay in the transformer, which runs them only when a call passes
        # `ip_adapter_image_embeds` (ours never does): the image tokens reach the processors
        # per row (`RowFluxIPAttention`).
        projections = transformer.encoder_hid_proj.image_projection_layers
        active = ActiveRows()
        loaded = transformer.attn_processors
        processors = {name: _row_processor(before[name], loaded[name], active) for name in loaded}
        transformer.set_attn_processor(processors)
        return cls(pipe, tuple(name for name, _ in sources), projections, active)

    def embeds(self, state: DenoiseState) -> tuple[Tensor, ...]:
        """Each reference image's CLIP embedding for the state's rows (a black image's for its
        negative rows, then its own for its positive rows), as `prepare_ip_adapter_image_embeds`
        lays them out for each of FluxPipeline's two passes."""
        out = []
        device, n = state.latents.device, state.num_images
        params = state.request.params
        for ref in state.request.ip_adapters:
            positive = self.pipe.encode_image(Image.fromarray(ref.image), device, 1)
            rows = [positive] * n
            if state.uncond is not None:
                # FluxPipeline's default: np.zeros((width, height, 3)), sides as it swaps them.
                black = np.zeros((resolved(params.width), resolved(params.height), 3), dtype=np.uint8)
                rows = [self.pipe.encode_image(black, device, 1)] * n + rows
            out.append(torch.cat(rows)[:, None])
        return tuple(out)


class RowFluxIPAttention(RowIPProcessor):
    """A double-stream block's attention processor: `base` (the transformer's own) where no row
    uses an IP-Adapter, else `base` and the image attention of the rows that use each adapter
    as diffusers' `FluxIPAdapterAttnProcessor` adds it, each row at its own scale."""

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        out = self.base(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if not self.active.adapters:
            return out
        image, text = out
        # The image query before rotary embedding, as the stock processor's `ip_query`.
        query = _query(attn, hidden_states)
        images = torch.zeros_like(image)
        for rows in self.active.adapters:  # in load order, as diffusers sums them
            images[rows.index] += self._images(attn, query[rows.index], rows)
        return image, text, images

    def _images(self, attn: Any, query: Tensor, rows: AdapterRows) -> Tensor:
        """`scale * attention(query, image tokens)` for `rows`, each at its own scale."""
        count = rows.index.shape[0]
        key = self.to_k_ip[rows.adapter](rows.tokens).view(count, -1, attn.heads, attn.head_dim)
        value = self.to_v_ip[rows.adapter](rows.tokens).view(count, -1, attn.heads, attn.head_dim)
        attended = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=None,
            dropout_p=0.0,
            is_causal=False,
            backend=getattr(self.base, "_attention_backend", None),
        )
        attended = attended.reshape(count, -1, attn.heads * attn.head_dim).to(query.dtype)
        scaled: Tensor = rows.scales * attended
        return scaled


def _query(attn: Any, hidden_states: Tensor) -> Tensor:
    """The attention's normalised image query, (rows, tokens, heads, head_dim)."""
    if attn.fused_projections:
        query = attn.to_qkv(hidden_states).chunk(3, dim=-1)[0]
    else:
        query = attn.to_q(hidden_states)
    normed: Tensor = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
    return normed


def _row_processor(before: Any, loaded: Any, active: ActiveRows) -> Any:
    """A `RowFluxIPAttention` where diffusers put its IP-Adapter processor (the double-stream
    blocks), else the processor the transformer had."""
    if isinstance(loaded, FluxIPAdapterAttnProcessor):
        return RowFluxIPAttention(before, loaded.to_k_ip, loaded.to_v_ip, active)
    return before
