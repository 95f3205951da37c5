"""The moderation settings (`ServeSettings` inherits this group): the image safety checker
every image is checked with after it is decoded (`pipelines.safety`,
`engine.worker.moderation`)."""

from __future__ import annotations

from pydantic import Field

from server.settings.section import Section


class ModerationSettings(Section):
    help_section = "moderation"
    each_model = False

    safety_checker: str | None = Field(
        None,
        description="check every image (and preview; a video by 4 of its frames) with this image "
        "safety classifier before it is sent: diffusers' Stable Diffusion safety checker "
        "(a directory or hub id such as CompVis/stable-diffusion-safety-checker, a pipeline "
        "directory with safety_checker/, or tiny-safety-checker for tests). A flagged image fails "
        "its own request with content_policy_violation; a request's moderation: low uses a "
        "lenient threshold (default: none, and moderation is not checked)",
    )
