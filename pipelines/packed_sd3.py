"""Stable Diffusion 3's MMDiT over a packed sequence: rows of different sizes end to end in a
batch of one (`pipelines.stepping.packed_rows`), so requests of different sizes share a
forward without padding (diffusers' `JointAttnProcessor2_0` takes no attention mask, so
SD3 cannot pad them to one grid).

As `pipelines.packed_flux` does for FLUX.1, this runs the transformer's own submodules in the
order of diffusers 0.42.1's `SD3Transformer2DModel.forward` and `JointTransformerBlock.forward`,
with every modulation computed per row and gathered to that row's tokens, and attention as
`JointAttnProcessor2_0` computes it (projections, optional q/k norms, no rotary embedding)
but over documents (`PackedRows.attend`). The patch embedding adds a position embedding
cropped to each image's size, so it runs per size on the rows of that size; the output is
unpatchified per size too. SD3.5's dual-attention blocks (`attn2`, a self-attention of the
image stream with its own modulation) and the last block's pre-only context are followed.

Not run: the hooks on the blocks (First-Block Cache), skip-layer guidance and ControlNet
residuals; a request with a cache keeps one step group per size (`Family.packs_sizes_for`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipelines.stepping.packed_rows import QKV, PackedRows, attention_backend, in_dtype_of, row_modulation


def packed_forward(
    transformer: Any,
    packed: PackedRows,
    latents: Tensor,
    *,
    grids: list[tuple[int, ...]],
    timestep: Tensor,
    pooled: Tensor,
    text: Tensor,
) -> Tensor:
    """The transformer's prediction for the rows of `latents` ((rows, C, H, W), each row's
    own latent at the top left, `grids` its (height, width) in patches): as `transformer(...)`
    gives each row alone, packed in one forward, zeros outside each row's own latent."""
    patch = int(transformer.config.patch_size)
    latents, timestep, pooled, text = in_dtype_of(transformer, latents, timestep, pooled, text)
    hidden = torch.cat(
        [
            transformer.pos_embed(latents[list(rows), :, : height * patch, : width * patch]).flatten(0, 1)
            for rows, (height, width) in _by_size(packed, grids)
        ]
    )[None]
    temb = transformer.time_text_embed(timestep, pooled)
    context = transformer.context_embedder(packed.pack_text(text))
    run = _Pass(packed, temb, attention_backend(transformer))
    for block in transformer.transformer_blocks:
        context, hidden = run.block(block, hidden, context)
    norm_out = transformer.norm_out
    scale, shift = row_modulation(norm_out, temb, run.image_rows, 2)
    out: Tensor = transformer.proj_out(norm_out.norm(hidden) * (1 + scale) + shift)
    result = latents.new_zeros(latents.shape[0], transformer.out_channels, *latents.shape[2:])
    start = 0
    for rows, (height, width) in _by_size(packed, grids):
        tokens = out[0, start : start + len(rows) * height * width]
        start += tokens.shape[0]
        unpatched = tokens.reshape(len(rows), height, width, patch, patch, -1)
        images = torch.einsum("nhwpqc->nchpwq", unpatched).reshape(
            len(rows), -1, height * patch, width * patch
        )
        result[list(rows), :, : height * patch, : width * patch] = images
    return result


def _by_size(
    packed: PackedRows, grids: list[tuple[int, ...]]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(rows, grid) for each run of rows of one size, in packing order (`PackedRows.order`
    sorts the rows by their token count, so rows of one size are adjacent)."""
    runs: list[tuple[list[int], tuple[int, ...]]] = []
    for row in packed.order:
        if runs and runs[-1][1] == grids[row]:
            runs[-1][0].append(row)
        else:
            runs.append(([row], grids[row]))
    return [(tuple(rows), grid) for rows, grid in runs]


class _Pass:
    """One packed forward: the rows' embeddings (`temb`, one per row), which row each token
    belongs to, and the attention backend of the blocks' processors."""

    def __init__(self, packed: PackedRows, temb: Tensor, backend: Any) -> None:
        self.packed, self.temb, self.backend = packed, temb, backend
        self.text_rows, self.image_rows = packed.text_rows(), packed.image_rows()

    def block(self, block: Any, hidden: Tensor, context: Tensor) -> tuple[Tensor, Tensor]:
        """`JointTransformerBlock.forward` with per-token modulation: (text, image) out; the
        text is passed through unchanged after a pre-only block (the last), which diffusers
        returns as None and nothing reads."""
        dual = block.use_dual_attention
        parts = row_modulation(block.norm1, self.temb, self.image_rows, 9 if dual else 6)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = parts[:6]
        normed = block.norm1.norm(hidden)
        norm_hidden = normed * (1 + scale_msa) + shift_msa
        if block.context_pre_only:
            scale, shift = row_modulation(block.norm1_context, self.temb, self.text_rows, 2)
            norm_context = block.norm1_context.norm(context) * (1 + scale) + shift
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = row_modulation(
                block.norm1_context, self.temb, self.text_rows, 6
            )
            norm_context = block.norm1_context.norm(context) * (1 + c_scale_msa) + c_shift_msa
        attn_output, context_attn_output = self._joint_attention(block.attn, norm_hidden, norm_context)
        hidden = hidden + gate_msa * attn_output
        if dual:
            shift_msa2, scale_msa2, gate_msa2 = parts[6:]
            hidden = hidden + gate_msa2 * self._image_attention(
                block.attn2, normed * (1 + scale_msa2) + shift_msa2
            )
        norm_hidden = block.norm2(hidden) * (1 + scale_mlp) + shift_mlp
        hidden = hidden + gate_mlp * block.ff(norm_hidden)
        if block.context_pre_only:
            return context, hidden
        context = context + c_gate_msa * context_attn_output
        norm_context = block.norm2_context(context) * (1 + c_scale_mlp) + c_shift_mlp
        context = context + c_gate_mlp * block.ff_context(norm_context)
        return context, hidden

    def _joint_attention(self, attn: Any, hidden: Tensor, context: Tensor) -> tuple[Tensor, Tensor]:
        """`JointAttnProcessor2_0` over the documents: (image output, text output; the text's
        unprojected where the block is pre-only, unused then)."""
        image = _heads(
            attn, (attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)), attn.norm_q, attn.norm_k
        )
        text = _heads(
            attn,
            (attn.add_q_proj(context), attn.add_k_proj(context), attn.add_v_proj(context)),
            attn.norm_added_q,
            attn.norm_added_k,
        )
        out = self.packed.attend(text, image, self.backend, image_first=True).flatten(2, 3).to(hidden.dtype)
        text_out, image_out = out.split_with_sizes([context.shape[1], hidden.shape[1]], dim=1)
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out

    def _image_attention(self, attn: Any, hidden: Tensor) -> Tensor:
        """`JointAttnProcessor2_0` without a context: the image stream's own attention."""
        image = _heads(
            attn, (attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)), attn.norm_q, attn.norm_k
        )
        out = self.packed.attend(None, image, self.backend).flatten(2, 3).to(hidden.dtype)
        return attn.to_out[1](attn.to_out[0](out))  # type: ignore[no-any-return]


def _heads(attn: Any, parts: QKV, norm_q: Any, norm_k: Any) -> QKV:
    """Projections split into `attn.heads` heads, queries and keys normed where the
    attention has norms (SD3.5's RMS norms; SD3 has none)."""
    query, key, value = (part.reshape(*part.shape[:-1], attn.heads, -1) for part in parts)
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value
