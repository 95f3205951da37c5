"""A model's components as its `model_index.json` lists them, read before anything loads
(torch-free): from a local diffusers directory, a shipped trained model, or the Hugging Face
cache. None where the index is not on disk yet (a tiny model not built, a hub model not
downloaded): the loader checks against it then."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.trained.shipped import MissingWeightsError, is_shipped_model, shipped_model_dir

INDEX = "model_index.json"


def local_components(model: str) -> list[str] | None:
    """The component names of `model`'s index (those it lists as unused too, `[null, null]`,
    as `from_pretrained` takes them), or None when the index is not on disk."""
    path = _index_path(model)
    if path is None:
        return None
    try:
        index: Any = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable: the load says what is wrong with it
        return None
    if not isinstance(index, dict):
        return None
    return [name for name, value in index.items() if isinstance(value, list) and len(value) == 2]


def _index_path(model: str) -> Path | None:
    if is_shipped_model(model):
        try:
            return shipped_model_dir(model) / INDEX
        except MissingWeightsError:
            return None
    local = Path(model).expanduser()
    if local.is_dir():
        return local / INDEX if (local / INDEX).is_file() else None
    try:  # a hub id (a tiny model's name is none: it is built on first use, by the loader)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id=model, filename=INDEX)
    except Exception:  # noqa: BLE001 - not a hub id at all: the load says so
        return None
    return Path(cached) if isinstance(cached, str) else None
