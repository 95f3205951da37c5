"""Embedded tiny IP-Adapters: `tiny-sd-ip-adapter` fits `tiny-sd`'s UNet,
`tiny-sdxl-ip-adapter` `tiny-sdxl`'s and `tiny-flux-ip-adapter` `tiny-flux`'s transformer,
each saved as the published IP-Adapters are (h94/IP-Adapter's `models/` folder for SD 1.5,
`sdxl_models/` for SDXL, XLabs-AI/flux-ip-adapter for FLUX.1): one safetensors file with the
image projection to 4 tokens (`image_proj.*`; XLabs' `ip_adapter_proj_model.*`) and one key
and value projection per cross-attention (`ip_adapter.<k>.to_k_ip/to_v_ip`, numbered as
diffusers numbers them; XLabs' `double_blocks.<k>.processor.ip_adapter_double_stream_k_proj`
and `_v_proj` per double-stream block, with biases), and a CLIP vision encoder with
projection in `image_encoder/` beside it, so diffusers' `load_ip_adapter` loads it through
the same code as real weights.

Weights are drawn at random (seeded), the value projections strong enough that swapping a
request's reference image moves its image well past the rounding of an 8-bit pixel.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from pipelines.tiny.cache import TINY_MODELS, build_once, cache_root, tiny_model_dir

_VERSION = 1
WEIGHTS = "ip-adapter.safetensors"
_TOKENS = 4  # diffusers' `ImageProjection` for a `proj.weight` state dict: 4 image tokens
_VALUE_GAIN = 4.0
# FLUX adds the image attention once per double-stream block, after the block's feed-forward.
_FLUX_VALUE_GAIN = 4.0
# Tiny IP-Adapter name -> the tiny model whose UNet it fits.
TINY_IP_ADAPTERS: dict[str, str] = {
    "tiny-sd-ip-adapter": "tiny-sd",
    "tiny-sdxl-ip-adapter": "tiny-sdxl",
    "tiny-flux-ip-adapter": "tiny-flux",
}


def is_tiny_ip_adapter(source: str) -> bool:
    return source in TINY_IP_ADAPTERS


def tiny_ip_adapter_dir(source: str, root: Path | None = None) -> Path:
    """The directory holding tiny IP-Adapter `source` (its weights file and `image_encoder/`),
    built first if needed."""
    model = TINY_IP_ADAPTERS[source]
    target = (root or cache_root()) / f"{model}-v{TINY_MODELS[model].version}-{source}-v{_VERSION}"
    base = tiny_model_dir(model, root)
    build = build_tiny_flux_ip_adapter if (base / "transformer").is_dir() else build_tiny_ip_adapter
    return build_once(target, WEIGHTS, lambda staging: build(base, staging))


def _image_encoder(directory: Path) -> int:
    """A tiny CLIP vision encoder with projection, saved in `image_encoder/`; its embedding width."""
    torch.manual_seed(0)
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            projection_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
    ).eval()
    encoder.save_pretrained(directory / "image_encoder", safe_serialization=True)
    return int(encoder.config.projection_dim)


def build_tiny_ip_adapter(model_dir: Path, directory: Path) -> None:
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    cross = int(unet.config.cross_attention_dim)
    embed = _image_encoder(directory)
    tensors = {
        "image_proj.proj.weight": torch.randn(cross * _TOKENS, embed) / embed**0.5,
        "image_proj.proj.bias": torch.randn(cross * _TOKENS) * 0.1,
        "image_proj.norm.weight": torch.ones(cross),
        "image_proj.norm.bias": torch.zeros(cross),
    }
    # diffusers numbers the processors in `unet.attn_processors` order from 0 and reads the
    # cross-attentions' weights at the odd numbers (1, 3, 5, ...).
    key_id = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        hidden = _hidden_size(unet, name)
        tensors[f"ip_adapter.{key_id}.to_k_ip.weight"] = torch.randn(hidden, cross) / cross**0.5
        tensors[f"ip_adapter.{key_id}.to_v_ip.weight"] = torch.randn(hidden, cross) * _VALUE_GAIN / cross**0.5
        key_id += 2
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS))


def build_tiny_flux_ip_adapter(model_dir: Path, directory: Path) -> None:
    """XLabs-AI/flux-ip-adapter's layout: the projection to 4 tokens of the transformer's text
    width, and a biased key and value projection per double-stream block."""
    config = FluxTransformer2DModel.load_config(model_dir, subfolder="transformer")
    cross = int(config["joint_attention_dim"])
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    embed = _image_encoder(directory)
    tensors = {
        "ip_adapter_proj_model.proj.weight": torch.randn(cross * _TOKENS, embed) / embed**0.5,
        "ip_adapter_proj_model.proj.bias": torch.randn(cross * _TOKENS) * 0.1,
        "ip_adapter_proj_model.norm.weight": torch.ones(cross),
        "ip_adapter_proj_model.norm.bias": torch.zeros(cross),
    }
    for block in range(int(config["num_layers"])):
        prefix = f"double_blocks.{block}.processor.ip_adapter_double_stream"
        tensors[f"{prefix}_k_proj.weight"] = torch.randn(inner, cross) / cross**0.5
        tensors[f"{prefix}_k_proj.bias"] = torch.zeros(inner)
        tensors[f"{prefix}_v_proj.weight"] = torch.randn(inner, cross) * _FLUX_VALUE_GAIN / cross**0.5
        tensors[f"{prefix}_v_proj.bias"] = torch.zeros(inner)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS))


def _hidden_size(unet: UNet2DConditionModel, name: str) -> int:
    """A processor's attention width, as `_convert_ip_adapter_attn_to_diffusers` reads it."""
    channels = list(unet.config.block_out_channels)
    if name.startswith("mid_block"):
        return int(channels[-1])
    block = int(name[len("up_blocks.")]) if name.startswith("up_blocks") else int(name[len("down_blocks.")])
    return int(list(reversed(channels))[block] if name.startswith("up_blocks") else channels[block])
