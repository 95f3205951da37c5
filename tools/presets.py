"""The presets in `configs/` and the diffusers class each one serves, known without weights.

A preset names its model (a hub id, an embedded name or a directory) and maybe an adapter
(`pipeline_class`); which diffusers class that is comes from the adapter's use, else the
model's `model_index.json`: the embedded models' own, and for hub ids the published one,
kept in `configs/model_indexes/ORG--NAME.json` (no network here, and a preset whose model
has none there is an error a test names: a typo in a model id fails CI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MODEL_INDEXES = CONFIGS / "model_indexes"


@dataclass(frozen=True, slots=True)
class Preset:
    path: Path
    values: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def model(self) -> str:
        return str(self.values.get("model", ""))


def presets(directory: Path = CONFIGS) -> list[Preset]:
    """Every `*.yaml` of `directory`, in name order."""
    return [Preset(path, yaml.safe_load(path.read_text()) or {}) for path in sorted(directory.glob("*.yaml"))]


def index_file(model: str) -> Path:
    """Where the published `model_index.json` of hub id `model` is kept."""
    return MODEL_INDEXES / f"{model.replace('/', '--')}.json"


def model_index(model: str) -> dict[str, Any] | None:
    """The `model_index.json` of `model` without its weights: an embedded model's (a tiny one
    is built first, in seconds), a local directory's, or the kept copy of a hub id's; None
    where none is known."""
    from pipelines.loading import resolve_model_path

    for candidate in (Path(resolve_model_path(model)) / "model_index.json", index_file(model)):
        if candidate.is_file():
            index: dict[str, Any] = json.loads(candidate.read_text())
            return index
    return None


def preset_class(preset: Preset) -> str | None:
    """The diffusers class a preset serves: its adapter's use where it names one (an
    image-to-image adapter over text-to-image weights), else its model index's class."""
    spec = preset.values.get("pipeline_class")
    if spec:
        from pipelines.registry import import_pipeline_class

        use = getattr(import_pipeline_class(str(spec)), "use", None)
        if use is not None and use.diffusers_class:
            return str(use.diffusers_class)
    index = model_index(preset.model)
    return None if index is None else str(index.get("_class_name"))


def write_index(model: str, class_name: str) -> Path:
    """Keep a model index for hub id `model` whose published one is not at hand: the index of
    the tiny model of `class_name` (its builder mirrors the published components), with the
    class named. Check it against the model card's `model_index.json` when you can."""
    from pipelines.tiny import TINY_MODELS, tiny_model_dir

    for name in TINY_MODELS:
        index = json.loads((tiny_model_dir(name) / "model_index.json").read_text())
        if index.get("_class_name") == class_name:
            kept = {
                "_class_name": class_name,
                **{k: v for k, v in sorted(index.items()) if not k.startswith("_")},
            }
            path = index_file(model)
            path.write_text(json.dumps(kept, indent=2) + "\n")
            return path
    raise ValueError(f"no tiny model of class {class_name}; write {index_file(model)} by hand")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m tools.presets HUB_ID DIFFUSERS_CLASS  (writes its kept model index)")
    print(write_index(sys.argv[1], sys.argv[2]))
