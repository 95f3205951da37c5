"""FLUX.2's transformer over a packed sequence: rows of different sizes end to end in a batch
of one (`pipelines.stepping.packed_rows`), as `pipelines.packed_flux` does for FLUX.1.

FLUX.2's blocks take their modulation from outside (`temb_mod_img`, `temb_mod_txt`,
`temb_mod`: one vector per batch row, computed once a forward) and apply it as it comes, so
a modulation gathered to each token ((1, tokens, k x dim), as diffusers' own reference-token
blending builds) passes through them unchanged: this module calls the blocks themselves and
writes only the transformer's outer `forward` (embeddings, the modulations per token, each
row's own positions, the output norm per token). Attention is the blocks' processors' with
the documents kept apart (`PackedRows.attend`): for the packed forward each attention module
gets a processor that does what diffusers 0.42.1's `Flux2AttnProcessor` and
`Flux2ParallelSelfAttnProcessor` do, over documents, and gets its own back after.

Not run: reference images (their tokens follow each row's own, one layout per forward; such
requests do not mix sizes), First-Block Cache (its decisions are per batch row): a forward
carrying either keeps the padded grid or its size (`Flux2.packs_sizes_for`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections
from torch import Tensor

from pipelines.packed_flux import rotated, split_heads
from pipelines.stepping.packed_rows import QKV, PackedRows, attention_backend, in_dtype_of, row_modulation


def packed_forward(
    transformer: Any,
    packed: PackedRows,
    latents: Tensor,
    *,
    timestep: Tensor,
    guidance: Tensor | None,
    text: Tensor,
    text_ids: Tensor,
    image_ids: Tensor,
) -> Tensor:
    """The transformer's prediction for the rows of `latents` ((rows, tokens, C), each row's
    own tokens first): as `transformer(...)` gives each row alone, packed in one forward.
    `timestep` and `guidance` per row, / 1000 as Flux2Pipeline passes them; `text_ids` one
    row's text positions (every row's are the same), `image_ids` the packed image tokens'."""
    dtype = transformer.dtype
    latents, text = in_dtype_of(transformer, latents, text)
    timestep = timestep.to(dtype) * 1000
    temb = transformer.time_guidance_embed(timestep, None if guidance is None else guidance.to(dtype) * 1000)
    image_rows, text_rows = packed.image_rows(), packed.text_rows()
    # Gathered to tokens, the modulations weigh 6 x dim per token (double-stream) and 3 x dim
    # (single-stream): each is made where its blocks start and dropped after them.
    mod_image = transformer.double_stream_modulation_img(temb)[image_rows][None]
    mod_text = transformer.double_stream_modulation_txt(temb)[text_rows][None]
    hidden = transformer.x_embedder(packed.pack(latents))
    context = transformer.context_embedder(packed.pack_text(text))
    image_rotary = transformer.pos_embed(image_ids)
    text_rotary = transformer.pos_embed(text_ids.repeat(packed.rows, 1))
    rotary = (torch.cat([text_rotary[0], image_rotary[0]]), torch.cat([text_rotary[1], image_rotary[1]]))
    with _documents(transformer, packed):
        for block in transformer.transformer_blocks:
            context, hidden = block(
                hidden_states=hidden,
                encoder_hidden_states=context,
                temb_mod_img=mod_image,
                temb_mod_txt=mod_text,
                image_rotary_emb=rotary,
            )
        del mod_image, mod_text
        mod_single = transformer.single_stream_modulation(temb)[packed.joint_rows()][None]
        joint = torch.cat([context, hidden], dim=1)
        for block in transformer.single_transformer_blocks:
            joint = block(
                hidden_states=joint, encoder_hidden_states=None, temb_mod=mod_single, image_rotary_emb=rotary
            )
    hidden = joint[:, context.shape[1] :]
    norm_out = transformer.norm_out
    scale, shift = row_modulation(norm_out, temb, image_rows, 2)
    out: Tensor = transformer.proj_out(norm_out.norm(hidden) * (1 + scale) + shift)
    return packed.unpack(out, latents.shape[1])


@contextmanager
def _documents(transformer: Any, packed: PackedRows) -> Iterator[None]:
    """Every block's attention over the packed rows' documents for the duration."""
    joint = [block.attn for block in transformer.transformer_blocks]
    parallel = [block.attn for block in transformer.single_transformer_blocks]
    modules = [*joint, *parallel]
    own = [module.processor for module in modules]
    backend = attention_backend(transformer)
    try:
        for module in joint:
            module.processor = _JointDocuments(packed, backend)
        for module in parallel:
            module.processor = _ParallelDocuments(packed, backend)
        yield
    finally:
        for module, processor in zip(modules, own, strict=True):
            module.processor = processor


class _Documents:
    """What both processors share: the packed rows, the backend, and attention with each
    part's own positions."""

    def __init__(self, packed: PackedRows, backend: Any) -> None:
        self.packed, self.backend = packed, backend

    def attend(self, text: QKV, image: QKV, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """(1, L, heads x dim) over [all text, all image], each row its own document."""
        size = text[0].shape[1]
        text = rotated(text, (rotary[0][:size], rotary[1][:size]))
        image = rotated(image, (rotary[0][size:], rotary[1][size:]))
        return self.packed.attend(text, image, self.backend).flatten(2, 3).to(image[0].dtype)


class _JointDocuments(_Documents):
    """`Flux2AttnProcessor` (a double-stream block's) over the documents."""

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert image_rotary_emb is not None
        query, key, value, c_query, c_key, c_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        image = split_heads(attn, (query, key, value), attn.norm_q, attn.norm_k)
        text = split_heads(attn, (c_query, c_key, c_value), attn.norm_added_q, attn.norm_added_k)
        out = self.attend(text, image, image_rotary_emb)
        text_out, image_out = out.split_with_sizes(
            [encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1
        )
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


class _ParallelDocuments(_Documents):
    """`Flux2ParallelSelfAttnProcessor` (a single-stream block's: attention and MLP from one
    projection) over the documents of the joint sequence."""

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        assert image_rotary_emb is not None
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = projected.split_with_sizes([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        parts = split_heads(attn, tuple(qkv.chunk(3, dim=-1)), attn.norm_q, attn.norm_k)
        text_tokens = self.packed.rows * self.packed.text
        split = [text_tokens, hidden_states.shape[1] - text_tokens]
        text, image = zip(*(part.split_with_sizes(split, dim=1) for part in parts), strict=True)
        out = self.attend(text, image, image_rotary_emb)
        result: Tensor = attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
        return result
