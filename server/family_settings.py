"""Family call settings of `ServeSettings` (a base it inherits, so each is a flag and a YAML
key like the rest): arguments of one family's diffusers call that a served model may set for
every request, each left at the pipeline's own default when unset (`pipelines.family_options`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipelines.family_options import FamilyOptions


class FamilySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg_truncation: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Z-Image: classifier-free guidance is off once a step's normalised time "
        "(1 - t/1000) passes this; 1 keeps it on to the end (default: the pipeline's, 1.0)",
    )
    cfg_normalization: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Z-Image: cap each guided prediction's norm at this many times the "
        "conditional prediction's; 0 for no cap (default: the pipeline's, none)",
    )
    reference_resolution: int | None = Field(
        None,
        ge=32,
        description="Qwen-Image 2.1: its call's output_resolution, the side of the square "
        "area reference images are resized to and an edit's default size (default: the "
        "pipeline's, 1024)",
    )

    def family_options(self) -> FamilyOptions:
        return FamilyOptions(
            cfg_truncation=self.cfg_truncation,
            cfg_normalization=self.cfg_normalization,
            reference_resolution=self.reference_resolution,
        )
