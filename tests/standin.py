"""A stand-in for the shipped shapes weights: each trained pipeline saved by its own builders
(`pipelines.trained.sd` / `flux`) with freshly initialised, seeded weights — never trained.

It has the shape of the real files (classes, configs, tokenizers, safetensors), so the
plumbing that names, ships, loads, serves and scores the trained models is tested before
(and after) the real weights are in the package. Its pictures are noise: no test may read
a quality figure into them.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.trained.shipped import SHIPPED_MODELS


def build_standin(directory: Path, name: str, seed: int = 0) -> Path:
    """Save the untrained pipeline of shipped model `name` to `directory` (deterministic)."""
    from pipelines.trained.components import build_autoencoder
    from pipelines.trained.flux import FluxTrainer
    from pipelines.trained.sd import SDTrainer

    family = SDTrainer if SHIPPED_MODELS[name].pipeline_class == "StableDiffusionPipeline" else FluxTrainer
    trainer = family(build_autoencoder(seed).eval(), seed)
    trainer.pipeline().save_pretrained(directory, safe_serialization=True)
    return directory


def build_standin_root(root: Path) -> Path:
    """A weights folder holding a stand-in for every shipped model (`root/NAME/`)."""
    for name in SHIPPED_MODELS:
        build_standin(root / name, name)
    return root
