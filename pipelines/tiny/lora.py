"""Embedded tiny LoRA adapters: `tiny-lora-<n>` is a rank-4 LoRA with random weights (seed
n) on the attention projections of a tiny model's denoiser, saved in diffusers' LoRA format.

Built offline and deterministically on first use, for the tiny model being served (the
adapter must fit its layers), into the cache beside the tiny models, then loaded with
`load_lora_weights` like any adapter on disk. They change the image visibly, as a real
LoRA would; their images are noise too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from pipelines.tiny.cache import TINY_MODELS, build_once, cache_root, tiny_model_dir

_NAME = re.compile(r"tiny-lora-([0-9]{1,6})")
_VERSION = 1
WEIGHTS = "pytorch_lora_weights.safetensors"
# In every family's denoiser (UNet and DiT alike): the attention and the output projections.
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
# Scaling alpha / r = 4: strong enough to change the images of every tiny family visibly.
ALPHA = 16


def is_tiny_lora(source: str) -> bool:
    return _NAME.fullmatch(source) is not None


def tiny_lora_dir(source: str, model: str, root: Path | None = None) -> Path:
    """The directory holding tiny LoRA `source` for tiny model `model`, built if needed."""
    match = _NAME.fullmatch(source)
    if match is None:
        raise ValueError(f"{source!r} is not a tiny LoRA name (tiny-lora-<n>)")
    if model not in TINY_MODELS:
        raise ValueError(f"{source} fits the embedded tiny models only, not {model}")
    seed = int(match.group(1))
    # Keyed by the model's version too: a rebuilt model may have other layers or weights.
    target = (root or cache_root()) / f"{model}-v{TINY_MODELS[model].version}-lora-{seed}-v{_VERSION}"
    base = tiny_model_dir(model, root)
    return build_once(target, WEIGHTS, lambda staging: build_tiny_lora(base, seed, staging))


def build_tiny_lora(model_dir: Path, seed: int, directory: Path) -> None:
    """A LoRA for the denoiser (UNet or transformer) of the diffusers model in `model_dir`."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    index = json.loads((model_dir / "model_index.json").read_text())
    component = "unet" if "unet" in index else "transformer"
    model_class = getattr(diffusers, index[component][1])
    denoiser = model_class.from_pretrained(model_dir, subfolder=component)
    torch.manual_seed(seed)
    # Random B as well as A (PEFT's default B is zero, a LoRA that changes nothing).
    config = LoraConfig(r=4, lora_alpha=ALPHA, target_modules=TARGET_MODULES, init_lora_weights=False)
    denoiser.add_adapter(config)
    layers = get_peft_model_state_dict(denoiser)
    pipeline_class = getattr(diffusers, index["_class_name"])
    pipeline_class.save_lora_weights(directory, **{f"{component}_lora_layers": layers})
