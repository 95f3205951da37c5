"""IP-Adapter cross-attention with a scale per row, for a UNet forward that mixes requests
with different reference images, different scales and none.

diffusers' `IPAdapterAttnProcessor2_0` adds `scale * attention(query, image tokens)` to
each cross-attention's output before its out-projection, with one scale per loaded
IP-Adapter for the whole call (`set_ip_adapter_scale`): a batched forward cannot give two
requests two scales, and every row must carry image tokens. `RowIPAttention` keeps
diffusers' key and value projections (`to_k_ip`, `to_v_ip`, loaded by `load_ip_adapter`)
and adds, for each adapter in use at this forward, the image attention of the rows that use
it, times each row's own scale, to those rows only. With no row in use it is the processor
the UNet had before the adapter was loaded, called as it was, so a forward without reference
images is exactly the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class AdapterRows:
    """The rows of one forward that one IP-Adapter steers: their indices, their projected
    image tokens (one set per row) and their scales (one per row)."""

    adapter: int
    index: Tensor
    tokens: Tensor
    scales: Tensor


@dataclass
class ActiveRows:
    """What the processors read during one UNet forward, set by `IPAdapters.applied` (the
    step runs on one thread, one forward at a time)."""

    adapters: list[AdapterRows] = field(default_factory=list)


class RowIPProcessor(nn.Module):
    """An attention processor wrapped around the model's own (`base`) with an IP-Adapter's
    key and value projections (one per adapter), which reads the rows that use each adapter
    from `active` at each forward."""

    def __init__(self, base: Any, to_k_ip: nn.ModuleList, to_v_ip: nn.ModuleList, active: ActiveRows):
        super().__init__()
        self.base = base
        self.to_k_ip = to_k_ip
        self.to_v_ip = to_v_ip
        self.active = active


class RowIPAttention(RowIPProcessor):
    """A cross-attention processor: `base` (the UNet's own) where no row uses an IP-Adapter,
    else diffusers' IP-Adapter attention restricted to the rows that use each adapter."""

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        temb: Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        if not self.active.adapters:
            out: Tensor = self.base(
                attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs
            )
            return out
        return self._with_images(attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    def _with_images(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None,
        attention_mask: Tensor | None,
        temb: Tensor | None,
    ) -> Tensor:
        """`IPAdapterAttnProcessor2_0.__call__` without masks, its image branch per row."""
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        hidden_states = scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        for rows in self.active.adapters:  # in load order, as diffusers adds them
            hidden_states = self._add_images(attn, hidden_states, query, rows, head_dim)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor  # type: ignore[no-any-return]

    def _add_images(
        self, attn: Any, hidden_states: Tensor, query: Tensor, rows: AdapterRows, head_dim: int
    ) -> Tensor:
        """`hidden + scale * attention(query, image tokens)` on `rows`, the others untouched."""
        count = rows.index.shape[0]
        ip_key = self.to_k_ip[rows.adapter](rows.tokens)
        ip_value = self.to_v_ip[rows.adapter](rows.tokens)
        ip_key = ip_key.view(count, -1, attn.heads, head_dim).transpose(1, 2)
        ip_value = ip_value.view(count, -1, attn.heads, head_dim).transpose(1, 2)
        images = scaled_dot_product_attention(
            query[rows.index], ip_key, ip_value, attn_mask=None, dropout_p=0.0, is_causal=False
        )
        images = images.transpose(1, 2).reshape(count, -1, attn.heads * head_dim).to(query.dtype)
        updated = hidden_states.clone()
        updated[rows.index] = hidden_states[rows.index] + rows.scales * images
        return updated
