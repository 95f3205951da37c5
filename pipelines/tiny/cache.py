"""Where tiny models are built and cached, and the table of known tiny models."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A builder, its version (bump it when the builder changes, so stale caches are never
    reused), and serving defaults that keep a tiny model fast on any CPU (some families
    hard-code a 1024-pixel default size that only suits real weights).

    `served` is False for a model no family adapter serves (yet): it builds and loads with
    `DiffusionPipeline.from_pretrained`, and where its class is text-to-image the generic
    request-level adapter serves it (`pipelines.generic`), but whatever serves every family's
    tiny model skips it (a test keeps the flag true to the registry's families)."""

    version: int
    # "module:function" under `pipelines.tiny`: imported when the model is first built, so
    # the table costs nothing to import (the builders import diffusers pipelines and
    # transformers models of every family, about half a second per process, while a built
    # model loads through `from_pretrained` like any other).
    builder: str
    default_size: tuple[int, int] = (64, 64)
    default_steps: int = 8
    default_guidance_scale: float | None = None  # None: the family's
    served: bool = True

    def build(self, target: Path) -> None:
        module, function = self.builder.split(":")
        getattr(importlib.import_module(f"pipelines.tiny.{module}"), function)(target)


TINY_MODELS: dict[str, TinyModel] = {
    "tiny-sd": TinyModel(2, "sd:build_tiny_sd"),
    "tiny-sd-inpaint": TinyModel(3, "sd:build_tiny_sd_inpaint"),
    "tiny-sdxl": TinyModel(2, "sdxl:build_tiny_sdxl"),
    "tiny-sdxl-inpaint": TinyModel(2, "sdxl:build_tiny_sdxl_inpaint"),
    "tiny-sdxl-refiner": TinyModel(2, "sdxl:build_tiny_sdxl_refiner"),
    "tiny-sd3": TinyModel(3, "sd3:build_tiny_sd3"),
    "tiny-flux": TinyModel(2, "flux:build_tiny_flux"),
    "tiny-qwen-image": TinyModel(2, "qwen_image:build_tiny_qwen_image"),
    # Video: 32x32 (the smallest size LTX accepts); frames follow the request's seconds.
    "tiny-wan": TinyModel(2, "wan:build_tiny_wan", default_size=(32, 32)),
    "tiny-ltx": TinyModel(1, "ltx:build_tiny_ltx", default_size=(32, 32)),
    "tiny-ltx2": TinyModel(2, "ltx2:build_tiny_ltx2", default_size=(32, 32)),
    "tiny-wan-i2v": TinyModel(2, "wan_i2v:build_tiny_wan_i2v", default_size=(32, 32)),
    "tiny-qwen-image-edit": TinyModel(2, "qwen_image_edit:build_tiny_qwen_image_edit"),
    "tiny-qwen-image-edit-plus": TinyModel(2, "qwen_image_edit:build_tiny_qwen_image_edit_plus"),
    # Video families of issue 24: Wan 2.2 by the Wan family,
    # HunyuanVideo 1.5 by its own.
    "tiny-wan22": TinyModel(2, "wan22:build_tiny_wan22", default_size=(32, 32)),
    "tiny-wan22-i2v": TinyModel(2, "wan22:build_tiny_wan22_i2v", default_size=(32, 32)),
    "tiny-wan22-ti2v": TinyModel(2, "wan22_ti2v:build_tiny_wan22_ti2v", default_size=(32, 32)),
    "tiny-hunyuan-video15": TinyModel(2, "hunyuan_video15:build_tiny_hunyuan_video15", default_size=(32, 32)),
    "tiny-hunyuan-video15-i2v": TinyModel(
        2, "hunyuan_video15:build_tiny_hunyuan_video15_i2v", default_size=(32, 32)
    ),
    "tiny-wan-vace": TinyModel(3, "wan_vace:build_tiny_wan_vace", default_size=(32, 32)),
    # Issue 24's families, built before their adapters.
    "tiny-flux2": TinyModel(2, "flux2:build_tiny_flux2"),
    "tiny-flux2-klein": TinyModel(2, "flux2:build_tiny_flux2_klein"),
    "tiny-z-image": TinyModel(2, "z_image:build_tiny_z_image"),
    "tiny-flux-kontext": TinyModel(2, "flux_kontext:build_tiny_flux_kontext"),
    "tiny-flux-fill": TinyModel(2, "flux_fill:build_tiny_flux_fill"),
    "tiny-chroma": TinyModel(2, "chroma:build_tiny_chroma"),
    # Served by the Edit Plus adapter today, but one request per forward; issue 24 asks for step level.
    "tiny-qwen-image-edit-2511": TinyModel(2, "qwen_image_edit:build_tiny_qwen_image_edit_2511"),
    "tiny-qwen-image-21": TinyModel(3, "qwen_image_21:build_tiny_qwen_image_21"),
    "tiny-ovis-image": TinyModel(2, "ovis_image:build_tiny_ovis_image"),
    # Classes no family file will claim: the generic request-level adapter's test models.
    "tiny-pixart-sigma": TinyModel(1, "pixart_sigma:build_tiny_pixart_sigma", served=False),
    "tiny-sana": TinyModel(1, "sana:build_tiny_sana", served=False),
}


def is_tiny_model(name: str) -> bool:
    return name in TINY_MODELS


def cache_root() -> Path:
    """`$DIFFBATCH_CACHE_DIR`, else `$XDG_CACHE_HOME/diffbatch`, else `~/.cache/diffbatch`."""
    explicit = os.environ.get("DIFFBATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diffbatch"


def tiny_model_dir(name: str, root: Path | None = None) -> Path:
    """Return the directory holding tiny model `name`, building it first if needed."""
    if name not in TINY_MODELS:
        known = ", ".join(sorted(TINY_MODELS))
        raise ValueError(f"unknown tiny model {name!r}; known: {known}")
    model = TINY_MODELS[name]
    return build_once((root or cache_root()) / f"{name}-v{model.version}", "model_index.json", model.build)


def build_once(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """`target`, built first by `build` unless it already holds `marker`.

    The build goes to a temporary sibling directory that is renamed into place, so a
    crash mid-build or two processes building at once never leave a half-written model.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
            # Another process finished the same deterministic build first; keep theirs.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
