"""Packing rows of different sizes end to end (`pipelines.stepping.packed_rows`) and the
FLUX.1 and SD3 transformers over them (`pipelines.packed_flux`, `pipelines.packed_sd3`):
the layout's bookkeeping, attention kept to each row's own tokens (checked against one
masked SDPA call over the whole sequence), and the packed forward's output for each row
against the transformer's own forward of that row alone, through two of diffusers'
attention backends."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import FluxPipeline, SD3Transformer2DModel
from torch.nn.functional import scaled_dot_product_attention

from pipelines.packed_flux import packed_forward
from pipelines.packed_sd3 import packed_forward as packed_sd3_forward
from pipelines.stepping.packed_rows import PackedRows
from pipelines.tiny.flux import flux_transformer, text_guided

CPU = torch.device("cpu")
# Rows of three sizes out of order, two of one size apart: packing sorts them by length.
GRIDS = [(4, 4), (2, 2), (3, 3), (4, 4), (2, 3)]
TEXT = 6


def rows() -> PackedRows:
    return PackedRows.of(TEXT, tuple(h * w for h, w in GRIDS), CPU)


def test_rows_are_packed_by_length_and_come_back_to_their_places() -> None:
    packed = rows()
    assert packed.order == (1, 4, 2, 0, 3)
    assert packed.tokens == 5 * TEXT + 16 + 4 + 9 + 16 + 6
    latents = torch.zeros(5, 16, 3)
    for row, (h, w) in enumerate(GRIDS):
        latents[row, : h * w] = torch.arange(h * w)[:, None] + 100 * row
    flat = packed.pack(latents)
    assert flat.shape == (1, 51, 3)
    assert flat[0, :4, 0].tolist() == [100, 101, 102, 103]  # row 1 first, its own 4 tokens
    assert packed.image_rows().tolist() == [1] * 4 + [4] * 6 + [2] * 9 + [0] * 16 + [3] * 16
    assert packed.text_rows().tolist() == [row for row in packed.order for _ in range(TEXT)]
    back = packed.unpack(flat, 16)
    assert torch.equal(back, latents)  # padding after each row's own tokens: zeros, as given


def test_attention_stays_within_each_row() -> None:
    """`attend` (a batched call per size) equals one SDPA call over the joint sequence with a
    block-diagonal mask: no token sees another row's."""
    packed = rows()
    torch.manual_seed(0)
    heads, dim = 2, 8
    text = tuple(torch.randn(1, 5 * TEXT, heads, dim) for _ in range(3))
    image = tuple(torch.randn(1, 51, heads, dim) for _ in range(3))
    got = packed.attend(text, image, None)  # type: ignore[arg-type]
    query, key, value = (torch.cat(parts, dim=1).transpose(1, 2) for parts in zip(text, image, strict=True))
    owner = packed.joint_rows()
    mask = owner[:, None] == owner[None, :]
    reference = scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)
    assert (got - reference).abs().max() < 1e-5
    # The same sequence with one row's values changed: only that row's outputs move.
    moved = (image[0], image[1], image[2].clone())
    moved[2][0, :4] += 1  # the image tokens of row 1, packed first
    changed = (packed.attend(text, moved, None) - got).abs().amax(dim=(0, 2, 3))  # type: ignore[arg-type]
    own = (owner == 1).nonzero().flatten()
    assert changed[own].min() > 0
    assert changed[owner != 1].max() == 0


@pytest.mark.parametrize("backend", [None, "_native_math"])
def test_the_packed_forward_gives_each_row_its_forward_alone(backend: str | None) -> None:
    """Five rows at their own timesteps and guidance, packed: each row's prediction is the
    transformer's own forward of that row alone (float32, within 1e-4)."""
    transformer = text_guided(flux_transformer()).eval()
    if backend is not None:
        transformer.set_attention_backend(backend)
    config = transformer.config
    torch.manual_seed(1)
    count, longest = len(GRIDS), max(h * w for h, w in GRIDS)
    latents = torch.zeros(count, longest, config.in_channels)
    for row, (h, w) in enumerate(GRIDS):
        latents[row, : h * w] = torch.randn(h * w, config.in_channels)
    timestep, guidance = torch.rand(count), torch.rand(count) * 5
    pooled = torch.randn(count, config.pooled_projection_dim)
    text = torch.randn(count, TEXT, config.joint_attention_dim)
    packed = rows()

    def ids(h: int, w: int) -> torch.Tensor:
        made: torch.Tensor = FluxPipeline._prepare_latent_image_ids(1, h, w, CPU, torch.float32)
        return made

    with torch.no_grad():
        out = packed_forward(
            transformer,
            packed,
            latents,
            timestep=timestep,
            guidance=guidance,
            pooled=pooled,
            text=text,
            image_ids=torch.cat([ids(h, w) for h, w in packed.in_order(GRIDS)]),
        )
        for row, (h, w) in enumerate(GRIDS):
            alone = transformer(
                hidden_states=latents[row : row + 1, : h * w],
                timestep=timestep[row : row + 1],
                guidance=guidance[row : row + 1],
                pooled_projections=pooled[row : row + 1],
                encoder_hidden_states=text[row : row + 1],
                txt_ids=torch.zeros(TEXT, 3),
                img_ids=ids(h, w),
                return_dict=False,
            )[0]
            assert alone.abs().max() > 1  # a real prediction to compare
            assert (out[row, : h * w] - alone[0]).abs().max() < 1e-4, row
            assert not out[row, h * w :].any()


@pytest.mark.parametrize("sd35", [False, True])
def test_the_packed_sd3_forward_gives_each_row_its_forward_alone(sd35: bool) -> None:
    """SD3's MMDiT packed (`pipelines.packed_sd3`): each row's prediction, at its own size in
    the top left of the batch's latent, is the transformer's own forward of that row alone;
    with SD3.5's q/k RMS norms and a dual-attention block too."""
    torch.manual_seed(2)
    extra: dict[str, Any] = {"qk_norm": "rms_norm", "dual_attention_layers": (0,)} if sd35 else {}
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        pooled_projection_dim=10,
        pos_embed_max_size=16,
        **extra,
    ).eval()
    sides = [(8, 8), (4, 6), (6, 6), (4, 6)]  # latent (height, width): grids of 2x2 patches
    count = len(sides)
    latents = torch.zeros(count, 4, 8, 8)
    for row, (h, w) in enumerate(sides):
        latents[row, :, :h, :w] = torch.randn(4, h, w)
    timestep = torch.rand(count) * 1000
    pooled, text = torch.randn(count, 10), torch.randn(count, TEXT, 12)
    grids: list[tuple[int, ...]] = [(h // 2, w // 2) for h, w in sides]
    packed = PackedRows.of(TEXT, tuple(h * w for h, w in grids), CPU)
    with torch.no_grad():
        out = packed_sd3_forward(
            transformer, packed, latents, grids=grids, timestep=timestep, pooled=pooled, text=text
        )
        for row, (h, w) in enumerate(sides):
            alone = transformer(
                hidden_states=latents[row : row + 1, :, :h, :w],
                timestep=timestep[row : row + 1],
                encoder_hidden_states=text[row : row + 1],
                pooled_projections=pooled[row : row + 1],
                return_dict=False,
            )[0]
            assert alone.abs().max() > 0.1
            assert (out[row, :, :h, :w] - alone[0]).abs().max() < 1e-4, row
            outside = out[row].clone()
            outside[:, :h, :w] = 0
            assert not outside.any()
