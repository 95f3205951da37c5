"""FLUX.1's transformer over a packed sequence: rows of different sizes end to end in a batch
of one (`pipelines.stepping.packed_rows`), so no token is computed that a row does not own.

diffusers' `FluxTransformer2DModel` takes one timestep embedding per batch row, and its
blocks modulate every token of a row alike (`scale[:, None]`). Packed, one batch row holds
many requests at their own timesteps and guidance, so the modulation must be per token:
this module runs the transformer's own submodules (embedders, attention, feed-forwards,
norms, projections: their weights, LoRA layers and attention processors as loaded) in the
order of diffusers 0.42.1's `forward` and its blocks' `forward`, with each modulation
computed per row and gathered to that row's tokens. Attention is `FluxAttnProcessor`'s,
step for step, but over documents (`PackedRows.attend`): the processor's one dispatcher
call would let every token attend to every row.

What it does not run: the hooks on the blocks (First-Block Cache), ControlNet residuals and
IP-Adapter attention, which are per batch row; a forward carrying any of them keeps the
padded grid (`Flux.packs_sizes_for`).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import _get_qkv_projections
from torch import Tensor

from pipelines.stepping.packed_rows import QKV, PackedRows, attention_backend, in_dtype_of, row_modulation


def packed_forward(
    transformer: Any,
    packed: PackedRows,
    latents: Tensor,
    *,
    timestep: Tensor,
    guidance: Tensor | None,
    pooled: Tensor,
    text: Tensor,
    image_ids: Tensor,
) -> Tensor:
    """The transformer's prediction for the rows of `latents` ((rows, tokens, C), each row's
    own tokens first): as `transformer(...)` gives each row alone, packed in one forward.
    `timestep` and `guidance` are per row, already / 1000 as FluxPipeline passes them;
    `image_ids` is the packed image tokens' positions (each row's own grid, `packed`'s order)."""
    latents, pooled, text = in_dtype_of(transformer, latents, pooled, text)
    hidden = transformer.x_embedder(packed.pack(latents))
    dtype = hidden.dtype
    timestep = timestep.to(dtype) * 1000
    if guidance is None:
        temb = transformer.time_text_embed(timestep, pooled)
    else:
        temb = transformer.time_text_embed(timestep, guidance.to(dtype) * 1000, pooled)
    context = transformer.context_embedder(packed.pack_text(text))
    text_ids = torch.zeros(context.shape[1], 3, device=image_ids.device, dtype=image_ids.dtype)
    run = _Pass(
        packed, temb, transformer.pos_embed(torch.cat([text_ids, image_ids])), attention_backend(transformer)
    )
    for block in transformer.transformer_blocks:
        context, hidden = run.double(block, hidden, context)
    joint = torch.cat([context, hidden], dim=1)
    for block in transformer.single_transformer_blocks:
        joint = run.single(block, joint)
    hidden = joint[:, context.shape[1] :]
    scale, shift = run.modulation(transformer.norm_out, run.image_rows, 2)
    out: Tensor = transformer.proj_out(transformer.norm_out.norm(hidden) * (1 + scale) + shift)
    return packed.unpack(out, latents.shape[1])


class _Pass:
    """One packed forward: the rows' embeddings (`temb`, one per row), which row each token
    belongs to, the rotary embedding of every token, and the attention backend."""

    def __init__(self, packed: PackedRows, temb: Tensor, rotary: tuple[Tensor, Tensor], backend: Any) -> None:
        self.packed, self.temb, self.backend = packed, temb, backend
        self.text_rows, self.image_rows = packed.text_rows(), packed.image_rows()
        self.joint_rows = packed.joint_rows()
        text = packed.rows * packed.text
        self.text_rotary = (rotary[0][:text], rotary[1][:text])
        self.image_rotary = (rotary[0][text:], rotary[1][text:])

    def modulation(self, norm: Any, rows: Tensor, parts: int) -> tuple[Tensor, ...]:
        return row_modulation(norm, self.temb, rows, parts)

    def double(self, block: Any, hidden: Tensor, context: Tensor) -> tuple[Tensor, Tensor]:
        """`FluxTransformerBlock.forward` with per-token modulation: (text, image) out."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.modulation(
            block.norm1, self.image_rows, 6
        )
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.modulation(
            block.norm1_context, self.text_rows, 6
        )
        norm_hidden = block.norm1.norm(hidden) * (1 + scale_msa) + shift_msa
        norm_context = block.norm1_context.norm(context) * (1 + c_scale_msa) + c_shift_msa
        attn_output, context_attn_output = self.joint_attention(block.attn, norm_hidden, norm_context)
        hidden = hidden + gate_msa * attn_output
        norm_hidden = block.norm2(hidden) * (1 + scale_mlp) + shift_mlp
        hidden = hidden + gate_mlp * block.ff(norm_hidden)
        context = context + c_gate_msa * context_attn_output
        norm_context = block.norm2_context(context) * (1 + c_scale_mlp) + c_shift_mlp
        context = context + c_gate_mlp * block.ff_context(norm_context)
        if context.dtype == torch.float16:
            context = context.clip(-65504, 65504)
        return context, hidden

    def single(self, block: Any, joint: Tensor) -> Tensor:
        """`FluxSingleTransformerBlock.forward` with per-token modulation, over [text, image]."""
        shift, scale, gate = self.modulation(block.norm, self.joint_rows, 3)
        norm_joint = block.norm.norm(joint) * (1 + scale) + shift
        mlp = block.act_mlp(block.proj_mlp(norm_joint))
        attn = block.attn
        query, key, value, *_ = _get_qkv_projections(attn, norm_joint)
        text_tokens = self.packed.rows * self.packed.text
        split = [text_tokens, joint.shape[1] - text_tokens]
        text, image = zip(
            *(
                part.split_with_sizes(split, dim=1)
                for part in split_heads(attn, (query, key, value), attn.norm_q, attn.norm_k)
            ),
            strict=True,
        )
        attn_output = self._attend(text, image)
        joint = joint + gate * block.proj_out(torch.cat([attn_output, mlp], dim=2))
        if joint.dtype == torch.float16:
            joint = joint.clip(-65504, 65504)
        return joint

    def joint_attention(self, attn: Any, hidden: Tensor, context: Tensor) -> tuple[Tensor, Tensor]:
        """`FluxAttnProcessor.__call__` for a double-stream block over the documents: the
        same projections, q/k norms and rotary embedding: (image output, text output)."""
        query, key, value, c_query, c_key, c_value = _get_qkv_projections(attn, hidden, context)
        image = split_heads(attn, (query, key, value), attn.norm_q, attn.norm_k)
        text = split_heads(attn, (c_query, c_key, c_value), attn.norm_added_q, attn.norm_added_k)
        out = self._attend(text, image)
        text_out, image_out = out.split_with_sizes([context.shape[1], hidden.shape[1]], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())

    def _attend(self, text: QKV, image: QKV) -> Tensor:
        """Rotary embedding on queries and keys, then attention over the documents:
        (1, L, heads x dim), as the processor returns it."""
        out = self.packed.attend(
            rotated(text, self.text_rotary), rotated(image, self.image_rotary), self.backend
        )
        return out.flatten(2, 3).to(text[0].dtype)


def split_heads(attn: Any, parts: QKV, norm_q: Any, norm_k: Any) -> QKV:
    """Projections split into heads of `attn.head_dim`, queries and keys normed (as FLUX.1's
    and FLUX.2's processors do)."""
    query, key, value = (part.reshape(*part.shape[:-1], -1, attn.head_dim) for part in parts)
    return norm_q(query), norm_k(key), value


def rotated(parts: QKV, rotary: tuple[Tensor, Tensor]) -> QKV:
    """Queries and keys with the rotary embedding of their tokens (`sequence_dim` 1)."""
    query, key, value = parts
    return (
        apply_rotary_emb(query, rotary, sequence_dim=1),
        apply_rotary_emb(key, rotary, sequence_dim=1),
        value,
    )
