"""Embedded tiny FLUX Redux: `tiny-flux-redux` fits `tiny-flux`, saved as
black-forest-labs/FLUX.1-Redux-dev is (a `FluxPriorReduxPipeline` directory: a SigLIP vision
encoder, its image processor, and the `ReduxImageEncoder` that maps each SigLIP token to one
token of the transformer's text width), so diffusers' `from_pretrained` loads it through the
same code as the published prior.

Weights are drawn at random (seeded); the embedder's output is scaled so that a request's
reference image moves its image well past the rounding of an 8-bit pixel.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FluxPriorReduxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.modeling_flux import ReduxImageEncoder
from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

from pipelines.tiny.cache import TINY_MODELS, build_once, cache_root, tiny_model_dir
from pipelines.tiny.gains import scale

_VERSION = 1
_SIDE = 32  # SigLIP's input side: 16 patches of 8 pixels, 16 image tokens
_EMBED_GAIN = 8.0
# Tiny Redux name -> the tiny model it fits.
TINY_REDUX: dict[str, str] = {"tiny-flux-redux": "tiny-flux"}


def is_tiny_redux(source: str) -> bool:
    return source in TINY_REDUX


def tiny_redux_dir(source: str, root: Path | None = None) -> Path:
    """The `FluxPriorReduxPipeline` directory of tiny Redux `source`, built first if needed."""
    model = TINY_REDUX[source]
    target = (root or cache_root()) / f"{model}-v{TINY_MODELS[model].version}-{source}-v{_VERSION}"
    base = tiny_model_dir(model, root)
    return build_once(target, "model_index.json", lambda staging: build_tiny_redux(base, staging))


def build_tiny_redux(model_dir: Path, directory: Path) -> None:
    config = FluxTransformer2DModel.load_config(model_dir, subfolder="transformer")
    torch.manual_seed(0)
    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=_SIDE,
            patch_size=8,
        )
    ).eval()
    embedder = ReduxImageEncoder(redux_dim=32, txt_in_features=int(config["joint_attention_dim"]))
    scale(embedder.redux_down, _EMBED_GAIN)
    processor = SiglipImageProcessor(size={"height": _SIDE, "width": _SIDE})
    prior = FluxPriorReduxPipeline(
        image_encoder=encoder, feature_extractor=processor, image_embedder=embedder
    )
    prior.save_pretrained(directory, safe_serialization=True)
