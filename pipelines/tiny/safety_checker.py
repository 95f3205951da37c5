"""`tiny-safety-checker`: diffusers' `StableDiffusionSafetyChecker` with a tiny random CLIP
vision model whose one live concept is pure red, for the tests of `--safety-checker`.

Its concept embedding is the tiny model's own embedding of a pure red (255, 0, 0) image and
its threshold sits just below that image's score, so a red image is flagged at the default
threshold (score +0.004) and passes the lenient one (`pipelines.safety.LENIENT_MARGIN`);
the nearest other colour measured (dark red, 200, 0, 0) scores -0.005, noise about -0.3.
Every other concept, and the special-care ones, can never fire (a threshold above any
cosine). Built offline and deterministically, cached like the tiny models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from transformers import CLIPConfig, CLIPImageProcessor

from pipelines.tiny.cache import build_once, cache_root

TINY_SAFETY_CHECKER = "tiny-safety-checker"
_VERSION = 1
# The flagged colour, and how far above the threshold its own score is.
FLAGGED_COLOUR = (255, 0, 0)
_SCORE = 0.004
# A threshold no cosine reaches: a concept that never fires.
_NEVER = 2.0


def tiny_safety_checker_dir(root: Path | None = None) -> Path:
    """The directory holding `tiny-safety-checker`, built first if need be."""
    target = (root or cache_root()) / f"{TINY_SAFETY_CHECKER}-v{_VERSION}"
    return build_once(target, "preprocessor_config.json", build_tiny_safety_checker)


def build_tiny_safety_checker(directory: Path) -> None:
    torch.manual_seed(0)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    config = CLIPConfig(
        text_config=small, vision_config={**small, "image_size": 32, "patch_size": 8}, projection_dim=32
    )
    checker = StableDiffusionSafetyChecker(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    red = np.full((32, 32, 3), FLAGGED_COLOUR, dtype=np.uint8)
    with torch.no_grad():
        pixels = processor(images=[red], return_tensors="pt").pixel_values
        embedding = checker.visual_projection(checker.vision_model(pixels)[1])[0]
        checker.concept_embeds.copy_(embedding.expand_as(checker.concept_embeds))
        checker.special_care_embeds.copy_(embedding.expand_as(checker.special_care_embeds))
        checker.concept_embeds_weights.fill_(_NEVER)
        checker.concept_embeds_weights[0] = 1.0 - _SCORE
        checker.special_care_embeds_weights.fill_(_NEVER)
    checker.save_pretrained(directory, safe_serialization=True)
    processor.save_pretrained(directory)
