"""The image safety checker of `--safety-checker SOURCE`: diffusers' Stable Diffusion safety
checker (`StableDiffusionSafetyChecker`: a CLIP vision model, and concept embeddings with a
threshold each), with its own weights or any others of the same architecture, and its CLIP
image processor.

SOURCE is `tiny-safety-checker` (built offline, for tests: `pipelines.tiny.safety_checker`),
a directory or hub id holding the checker's `config.json`, weights and
`preprocessor_config.json` (`CompVis/stable-diffusion-safety-checker` is one), or a local
diffusers pipeline directory with `safety_checker/` and `feature_extractor/`.

The test is diffusers' own (`StableDiffusionSafetyChecker.forward_onnx`): an image is flagged
when its cosine to a concept passes that concept's threshold (by 0.01 less for an image close
to a special-care concept). `moderation: "low"` asks for `LENIENT_MARGIN` more. Every image of
a group is judged in one forward, each at its own request's level. A video is judged by
`VIDEO_FRAMES` frames spread over it, its first and last among them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from transformers import CLIPImageProcessor

from engine.request import Moderation
from pipelines.tiny.safety_checker import TINY_SAFETY_CHECKER, tiny_safety_checker_dir

logger = logging.getLogger(__name__)

# How far past a concept's threshold an image must score to be flagged at moderation "low":
# twice diffusers' own special-care adjustment (0.01).
LENIENT_MARGIN = 0.02
# diffusers' adjustment for images close to a special-care concept: stricter by this much.
_SPECIAL_CARE = 0.01
# Frames of a video that are checked, spread evenly from its first to its last.
VIDEO_FRAMES = 4


class SafetyChecker:
    """A loaded safety checker on its device (`pipelines.base.ImageSafetyChecker`)."""

    def __init__(self, model: StableDiffusionSafetyChecker, processor: Any, device: str) -> None:
        self.model = model
        self.processor = processor
        self.device = device

    @classmethod
    def load(cls, source: str, device: str) -> SafetyChecker:
        model_dir, processor_dir = _locate(source)
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        model = StableDiffusionSafetyChecker.from_pretrained(model_dir, torch_dtype=dtype)
        processor = CLIPImageProcessor.from_pretrained(processor_dir)
        logger.info("safety checker %s loaded on %s", source, device)
        return cls(model.to(device).eval(), processor, device)

    def flags(self, images: list[tuple[Any, ...]], levels: list[Moderation]) -> list[bool]:
        pictures: list[np.ndarray] = []
        owners: list[int] = []
        margins: list[float] = []
        for owner, (arrays, level) in enumerate(zip(images, levels, strict=True)):
            for array in arrays:
                for picture in _pictures(np.asarray(array)):
                    pictures.append(picture)
                    owners.append(owner)
                    margins.append(LENIENT_MARGIN if level == "low" else 0.0)
        flagged = [False] * len(images)
        if not pictures:
            return flagged
        for owner, hit in zip(owners, self._flagged(pictures, margins), strict=True):
            flagged[owner] = flagged[owner] or hit
        return flagged

    @torch.inference_mode()
    def _flagged(self, pictures: list[np.ndarray], margins: list[float]) -> list[bool]:
        model = self.model
        pixels = self.processor(images=pictures, return_tensors="pt").pixel_values
        pixels = pixels.to(self.device, model.dtype)
        embeds = _unit(model.visual_projection(model.vision_model(pixels)[1]))
        margin = torch.tensor(margins, device=embeds.device, dtype=embeds.dtype).unsqueeze(1)
        special = embeds @ _unit(model.special_care_embeds).T - model.special_care_embeds_weights - margin
        special_care = torch.any(special > 0, dim=1, keepdim=True)
        concepts = embeds @ _unit(model.concept_embeds).T - model.concept_embeds_weights - margin
        concepts = concepts + special_care * _SPECIAL_CARE
        # One host sync for the whole group, at the end of the stage.
        result: list[bool] = torch.any(concepts > 0, dim=1).tolist()
        return result


def load_safety_checker(source: str, device: str) -> SafetyChecker:
    return SafetyChecker.load(source, device)


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, dim=-1)


def _pictures(array: np.ndarray) -> list[np.ndarray]:
    """An image, or `VIDEO_FRAMES` frames spread over a video (FxHxWx3)."""
    if array.ndim == 3:
        return [array]
    count = array.shape[0]
    picks = sorted({round(i * (count - 1) / max(1, VIDEO_FRAMES - 1)) for i in range(VIDEO_FRAMES)})
    return [array[i] for i in picks]


def _locate(source: str) -> tuple[str, str]:
    """Where the checker's weights and its image processor are: (model, processor)."""
    if source == TINY_SAFETY_CHECKER:
        built = str(tiny_safety_checker_dir())
        return built, built
    local = Path(source).expanduser()
    if (local / "safety_checker").is_dir() and (local / "feature_extractor").is_dir():
        return str(local / "safety_checker"), str(local / "feature_extractor")
    return source, source
