"""The several-models settings (`ServeSettings` inherits these groups): `--model NAME=SOURCE`
repeated, or a `models:` list in YAML where each model has its own settings; the memory
budget they share, and how much host memory idle models may be parked in rather than
dropped. They are the server's: a model's own settings are those of the groups a model may
set (`each_model`).

```yaml
models:
  - name: shapes            # the model id clients send (the first is the default)
    model: shapes           # what to load: as the positional MODEL
    preload: true           # load at start instead of on first use
  - name: klein
    model: black-forest-labs/FLUX.2-klein-4B
    config: configs/flux2-klein.yaml   # that model's preset
    offload: group          # any model, batching, worker or memory setting
```
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.settings.section import Section

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def deployment_suffix(name: str) -> str:
    """A model's name as Ray Serve deployment names allow it (letters, digits, '_', '-')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


class ModelEntry(BaseModel):
    """One served model: its name, what to load, and its own settings (the extra keys, each
    a model, batching, worker or memory setting; checked by `ServeSettings.for_entry`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    model: str
    preload: bool = False
    config: Path | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"model name {value!r}: use letters, digits, '.', '_', ':', '/' and '-'")
        return value

    def own_settings(self) -> dict[str, Any]:
        """Its preset's settings (`config`), then its own keys over them."""
        values: dict[str, Any] = {}
        if self.config is not None:
            try:
                loaded = yaml.safe_load(self.config.read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise ValueError(f"model {self.name!r}: cannot read its config {self.config}: {exc}") from exc
            if not isinstance(loaded, dict):
                raise ValueError(f"model {self.name!r}: its config {self.config} must be a mapping")
            values.update(loaded)
        values.update(self.model_extra or {})
        values.pop("served_model_name", None)  # the entry's name is the served name
        return values


class ModelSetSettings(Section):
    help_section = "several models"
    each_model = False

    models: list[ModelEntry] = Field(
        default_factory=list,
        description="serve several models, NAME=SOURCE each (repeat --model; YAML: a models: list "
        "where each has its own settings); requests pick one with model: NAME, the first is the "
        "default; each has its own engine, loaded on first use (default: the one MODEL)",
        json_schema_extra={"metavar": "NAME=SOURCE"},
    )
    models_memory_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="with several models: most MiB of weights loaded at once; to load another, the "
        "least recently used idle models are unloaded (never one running or with requests queued) "
        "(default: no limit)",
    )
    models_host_memory_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="with several models: most MiB of weights parked in host memory; a model "
        "unloaded to make room on the device moves there (its engine stays up) and comes back "
        "on its next request faster than a load, unless it uses offload or quantized weights "
        "or a worker process (then it is dropped); on the CPU both budgets are the same memory "
        "(default: none, unloaded models are dropped)",
    )
    ray_models_per_replica: int | None = Field(
        None,
        ge=1,
        description="Ray Serve with several models: one engine deployment serves them all, each "
        "replica holding up to this many at once (Serve's model multiplexing: many small models "
        "sharing replicas) (default: one deployment per model, with its own replicas)",
        json_schema_extra={"metavar": "K"},
    )

    def host_budget_bytes(self) -> int | None:
        mb = self.models_host_memory_mb
        return None if mb is None else int(mb * 2**20)

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> Any:
        """NAME=SOURCE from flags (a list) or a variable (comma-separated); mappings from YAML."""
        if isinstance(value, str):
            value = [part for part in re.split(r"[,\s]+", value) if part]
        if not isinstance(value, list | tuple):
            return value
        entries: list[Any] = []
        for item in value:
            if not isinstance(item, str):
                entries.append(item)
                continue
            name, sep, source = item.partition("=")
            if not sep or not name.strip() or not source.strip():
                raise ValueError(f"write each model as NAME=SOURCE, got {item!r}")
            entries.append({"name": name.strip(), "model": source.strip()})
        return entries

    @field_validator("models")
    @classmethod
    def _names_apart(cls, value: list[ModelEntry]) -> list[ModelEntry]:
        names = [entry.name for entry in value]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"each model name may be given once: {', '.join(repeated)}")
        # On Ray Serve each model is a deployment named after it: flux.1 and flux_1 would clash.
        suffixes = [deployment_suffix(name) for name in names]
        if clashing := sorted({n for n, s in zip(names, suffixes, strict=True) if suffixes.count(s) > 1}):
            raise ValueError(
                f"model names {', '.join(clashing)} differ only in characters other than "
                "letters, digits, '_' and '-': name them apart"
            )
        return value

    @model_validator(mode="after")
    def _multiplexing_needs_models(self) -> ModelSetSettings:
        if self.ray_models_per_replica is not None and not self.models:
            raise ValueError("--ray-models-per-replica multiplexes several models: give them with --model")
        return self
