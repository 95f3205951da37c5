"""The trained shapes models shipped inside the package: their names, where their weights
live (`pipelines/trained/weights/NAME/`, diffusers' own layout), and their serving defaults.

A shipped name resolves to its directory, which then loads like any model directory. Torch-
free: the server's settings and the benchmark read this table without loading anything.
The weights are copied in by `python -m pipelines.trained.ship RUN_DIR NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Where `ship` writes and `shipped_model_dir` reads (tests point it at a temporary folder).
WEIGHTS_ROOT = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A trained model: the diffusers class its directory must hold, and serving defaults
    (the 64x64 pictures it was trained on, and the steps and guidance it was scored at by
    `pipelines.trained.evaluate`; FLUX's default size would otherwise be 512x512, and its
    true CFG off)."""

    pipeline_class: str
    default_size: tuple[int, int] = (64, 64)
    default_steps: int = 20
    default_guidance_scale: float | None = None
    default_true_cfg_scale: float | None = None
    default_negative_prompt: str | None = None


SHIPPED_MODELS: dict[str, ShippedModel] = {
    # The UNet family (Stable Diffusion's classes): what `diffbatch serve` serves by default.
    "shapes": ShippedModel("StableDiffusionPipeline", default_guidance_scale=4.0),
    # The DiT family (FLUX's classes), batched step by step. Its guidance is true CFG, which
    # runs only with a negative prompt: on by default, at the scale it was scored at (a
    # request's own negative prompt or true_cfg_scale replaces these; true_cfg_scale=1 is off).
    "shapes-dit": ShippedModel("FluxPipeline", default_true_cfg_scale=4.0, default_negative_prompt=" "),
}
DEFAULT_MODEL = "shapes"


class MissingWeightsError(FileNotFoundError):
    """A shipped model's weights are not in this installation yet."""


def is_shipped_model(name: str) -> bool:
    return name in SHIPPED_MODELS


def shipped_model_dir(name: str, root: Path | None = None) -> Path:
    """The directory holding shipped model `name`; MissingWeightsError says how to put the
    weights there when they are not."""
    if name not in SHIPPED_MODELS:
        known = ", ".join(sorted(SHIPPED_MODELS))
        raise ValueError(f"unknown shipped model {name!r}; known: {known}")
    directory = (root or WEIGHTS_ROOT) / name
    if not (directory / "model_index.json").is_file():
        raise MissingWeightsError(
            f"the trained model {name!r} has no weights in this installation (expected "
            f"{directory}/model_index.json). Train one (docs/training.md) and copy it in with "
            f"`python -m pipelines.trained.ship RUN_DIR {name}`, or serve another model, "
            "e.g. `diffbatch serve tiny-sd` (random weights) or a diffusers directory"
        )
    return directory
