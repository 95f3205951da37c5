"""What every group of settings says of itself: the `--help` section its flags are listed
in, and whether one of several models may set it for itself (`ServeSettings.for_entry`).
`ServeSettings` inherits every group; the CLI and the per-model check read these two here,
so a setting is grouped once, where it is declared."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

# The `--help` section of the model's own settings, its batching and its workers (the first).
MODEL_SECTION = "model, batching and workers"


class Section(BaseModel):
    """A group of settings. Each subclass declares its fields (and nothing inherits them but
    `ServeSettings`), its `help_section` and `each_model`: True where each of several models
    may set them for itself (its engine's settings), False where they are the server's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    help_section: ClassVar[str]
    each_model: ClassVar[bool]
