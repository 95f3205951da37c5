"""Rows of different sizes as one packed sequence: every row's tokens laid end to end in a
batch of one, each row one attention document (issue 42's packing, the alternative to
`pipelines.stepping.padded_grid`, which computes the empty places of a shared grid too).

A joint-attention transformer (FLUX.1, FLUX.2, SD3) attends over [text, image]: the packed sequence is
every row's text, row after row, then every row's image tokens, row after row, and a token
attends only to the tokens of its own row (`attend`). Per-row values (the timestep and
guidance embedding, hence the blocks' modulation) reach each token through its row
(`text_rows`, `image_rows`, `joint_rows`): a gather of per-row tensors, so nothing per
token is computed that was not computed per row.

Attention goes through diffusers' dispatcher with the backend the transformer was given
(`--attention-backend`), once per run of rows of one size: their documents are all of one
length, so they attend as a batch, densely, with no mask and no padding, and every backend
takes them (the flash kernels, which take no mask, included). A block-diagonal mask over the
whole sequence (the native backend's way to keep documents apart) would compute every score
of it: for twelve FLUX rows of 512 text tokens and 32-64 px images, (12 x 512 + 1,856)^2 =
64M scores a head, against 7.1M for the padded grid and 5.4M for the documents by size; a
varlen kernel (`flash_varlen`'s cu_seqlens per document) would make one call of the runs,
which diffusers' dispatcher does not offer (its varlen backends take one length per batch
row, a padding mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import Tensor

# (query, key, value) of a part of the packed sequence, (1, tokens, heads, dim) each.
QKV = tuple[Tensor, Tensor, Tensor]


@dataclass(frozen=True, slots=True)
class PackedRows:
    """Where each row's tokens go in the packed sequence: `text` tokens per row (FLUX pads
    every prompt of a forward to one length) and each row's own image tokens (`image`, in
    the forward's row order). Rows are packed in `order`, by image length, so the rows of
    one size are adjacent: their documents, all of one length, attend in one batched call."""

    text: int
    image: tuple[int, ...]
    order: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, text: int, image: tuple[int, ...], device: torch.device) -> PackedRows:
        order = tuple(sorted(range(len(image)), key=lambda row: image[row]))
        return cls(text, image, order, device)

    @property
    def rows(self) -> int:
        return len(self.image)

    @property
    def tokens(self) -> int:
        """The packed sequence's length: every row's text and image tokens."""
        return self.rows * self.text + sum(self.image)

    def in_order(self, per_row: list[Any]) -> list[Any]:
        """`per_row` (one item per row of the forward) in packing order."""
        return [per_row[row] for row in self.order]

    def text_rows(self) -> Tensor:
        """(rows x text,): the row each packed text token belongs to."""
        return torch.tensor(self.order, device=self.device).repeat_interleave(self.text)

    def image_rows(self) -> Tensor:
        """(sum of image,): the row each packed image token belongs to."""
        lengths = torch.tensor(self.in_order(list(self.image)), device=self.device)
        return torch.tensor(self.order, device=self.device).repeat_interleave(lengths)

    def joint_rows(self) -> Tensor:
        """The row of every token of the joint sequence [all text, all image]."""
        return torch.cat([self.text_rows(), self.image_rows()])

    def pack(self, latents: Tensor) -> Tensor:
        """(1, sum of image, C): each row's own tokens (its first `image[row]`, as
        `pipelines.stepping.state.padded_cat` hands them over), end to end."""
        return torch.cat([latents[row, : self.image[row]] for row in self.order])[None]

    def pack_text(self, text: Tensor) -> Tensor:
        """(1, rows x text, D): the rows' text embeddings end to end."""
        return text[list(self.order)].reshape(1, -1, text.shape[-1])

    def unpack(self, out: Tensor, tokens: int) -> Tensor:
        """(rows, `tokens`, C): each row's outputs first, zeros after (as `pack` took them)."""
        result = out.new_zeros(self.rows, tokens, out.shape[-1])
        for row, part in zip(
            self.order, out[0].split_with_sizes(self.in_order(list(self.image))), strict=True
        ):
            result[row, : part.shape[0]] = part
        return result

    def attend(self, text: QKV | None, image: QKV, backend: Any, *, image_first: bool = False) -> Tensor:
        """Attention over the joint sequence [all text, all image] (or the image tokens alone,
        `text` None: a self-attention of the image stream), each row's tokens attending to
        its own only: `text` and `image` are the (query, key, value) of each part ((1,
        tokens, heads, dim) each), the output is the joint sequence's. One call through
        `backend` (diffusers' dispatcher name; None: the native one) per run of rows of one
        size, their documents (all of one length) as a batch, without a mask. Each document
        lays its keys as the transformer's own processor does, [text, image] or
        (`image_first`, SD3's) [image, text]: the same scores either way, summed in the same
        order, so a half-precision forward rounds as the processor's does."""
        own_text = 0 if text is None else self.text
        text_total = self.rows * own_text
        query = image[0]
        out = query.new_empty(1, text_total + sum(self.image), *query.shape[2:])
        text_at, image_at = 0, 0
        for count, length in self._runs():
            text_part = slice(text_at, text_at + count * own_text)
            image_part = slice(image_at, image_at + count * length)
            text_at, image_at = text_part.stop, image_part.stop
            batch = [_rows_of(part[0, image_part], count) for part in image]
            if text is not None:
                batch = [
                    torch.cat([rows, own] if image_first else [own, rows], dim=1)
                    for own, rows in (
                        (_rows_of(part[0, text_part], count), rows)
                        for part, rows in zip(text, batch, strict=True)
                    )
                ]
            done = dispatch_attention_fn(*batch, backend=backend)
            text_at_done = slice(length, None) if image_first else slice(0, own_text)
            image_at_done = slice(0, length) if image_first else slice(own_text, None)
            out[0, text_part] = done[:, text_at_done].flatten(0, 1)
            out[0, text_total + image_part.start : text_total + image_part.stop] = done[
                :, image_at_done
            ].flatten(0, 1)
        return out

    def _runs(self) -> list[tuple[int, int]]:
        """(rows, image length) of each run of rows of one length, in packing order."""
        runs: list[tuple[int, int]] = []
        for length in self.in_order(list(self.image)):
            if runs and runs[-1][1] == length:
                runs[-1] = (runs[-1][0] + 1, length)
            else:
                runs.append((1, length))
        return runs


def attention_backend(transformer: Any) -> Any:
    """The attention backend the transformer was given (`--attention-backend`), as its
    processors hold it: read from the first single-stream block's where there are such
    blocks, which no adapter wraps (an IP-Adapter's row attention replaces FLUX's
    double-stream processors and keeps the original as `base`), else the first block's;
    None (diffusers' native) where none is set."""
    blocks = [
        block
        for name in ("single_transformer_blocks", "transformer_blocks")
        for block in getattr(transformer, name, ())
    ]
    processor = blocks[0].attn.processor if blocks else None
    return getattr(
        processor, "_attention_backend", getattr(getattr(processor, "base", None), "_attention_backend", None)
    )


def in_dtype_of(transformer: Any, *tensors: Tensor) -> list[Tensor]:
    """`tensors` in the transformer's own dtype, as `--component-dtypes`' forward pre-hook
    casts its inputs (`pipelines.memory.dtypes`): a packed forward calls the transformer's
    parts, not its `forward`, so no hook casts them."""
    dtype = transformer.dtype
    return [tensor.to(dtype) if tensor.is_floating_point() else tensor for tensor in tensors]


def row_modulation(norm: Any, temb: Tensor, rows: Tensor, parts: int) -> tuple[Tensor, ...]:
    """A modulating norm's `parts` (shift, scale, gate, ...) for each token of `rows` (the
    row each token belongs to): the norm's projection of every row's embedding `temb`, as
    its own `forward` computes it for a batch (diffusers' AdaLayerNorm kinds: `linear` over
    `silu`), gathered to the tokens of that row."""
    emb: Tensor = norm.linear(norm.silu(temb).to(temb.dtype))
    return emb[rows].chunk(parts, dim=-1)


def _rows_of(tokens: Tensor, count: int) -> Tensor:
    """(count x length, ...) tokens of `count` rows of one length as (count, length, ...)."""
    return tokens.reshape(count, -1, *tokens.shape[1:])
