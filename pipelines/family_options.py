"""Settings of one family's diffusers call that a served model may override (`--cfg-truncation`,
`--reference-resolution` ...): None leaves the pipeline's own default, read from its `__call__`
signature, so a default that changes in diffusers changes here too."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FamilyOptions:
    """`cfg_truncation` and `cfg_normalization`: Z-Image's guidance cut-off (normalised time
    past which guidance is off) and cap (guided norm at most this many times the conditional
    one's; 0: none). `reference_resolution`: Qwen-Image 2.1's `output_resolution` (references
    are resized to about its square; an edit's default size)."""

    cfg_truncation: float | None = None
    cfg_normalization: float | None = None
    reference_resolution: int | None = None


def call_default(pipe: Any, name: str) -> Any:
    """The default of argument `name` of `pipe`'s `__call__`."""
    default = inspect.signature(type(pipe).__call__).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{type(pipe).__name__}.__call__ has no default for {name}")
    return default
