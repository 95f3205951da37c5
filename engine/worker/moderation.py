"""Moderation of what a pipeline made, where it was made: the images of requests that ended
and their previews go through the pipeline's safety checker (`--safety-checker`) after they
are decoded and before anything encodes them, in one call per group of requests (the batch,
or the requests decoded together). A flagged request fails alone with `ContentPolicyError`
(its peers keep their images); a flagged preview is withheld, and the request goes on (its
final images are checked too, and they decide). A checker that fails lets nothing through:
the requests it was checking fail with it, and their previews are withheld.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from engine.errors import ContentPolicyError, ForwardError
from engine.outputs import BatchOutput, ModerationRecord
from engine.request import GenerationRequest

logger = logging.getLogger(__name__)


class ModeratedPipeline(Protocol):
    def moderates(self) -> bool:
        """Whether it has a safety checker (without one nothing is checked or counted)."""
        ...

    def moderate(self, requests: list[GenerationRequest], images: list[tuple[Any, ...]]) -> list[bool]:
        """For each request, whether its images (uint8 HxWx3 arrays, or FxHxWx3 frames of a
        video, as decoded) are flagged at its own `params.moderation` threshold."""
        ...


def moderate_outputs(
    pipeline: ModeratedPipeline, requests: Mapping[str, GenerationRequest], result: BatchOutput
) -> None:
    """Check the outputs in `result` of `requests`, together; a flagged one becomes its
    request's error."""
    ids = [rid for rid in requests if rid in result.outputs and _checkable(requests[rid])]
    if not ids or not pipeline.moderates():
        return
    try:
        flags = pipeline.moderate([requests[rid] for rid in ids], [result.outputs[rid].images for rid in ids])
    except Exception as exc:
        logger.exception("the safety checker failed for %s; they fail with it", ids)
        for rid in ids:
            del result.outputs[rid]
            result.errors[rid] = ForwardError(f"the safety checker failed: {type(exc).__name__}: {exc}")
        return
    flagged = [rid for rid, flag in zip(ids, flags, strict=True) if flag]
    for rid in flagged:
        logger.info("request %s: its images were flagged by the safety checker", rid)
        del result.outputs[rid]
        result.errors[rid] = ContentPolicyError(requests[rid].params.moderation)
    result.moderations.append(ModerationRecord("image", len(ids), len(flagged)))


def moderate_previews(
    pipeline: ModeratedPipeline,
    requests: list[GenerationRequest],
    previews: list[tuple[Any, ...] | None],
    result: BatchOutput | None = None,
) -> list[tuple[Any, ...] | None]:
    """`previews` (one per request; None: none was made) with the flagged ones withheld
    (None), counted in `result`."""
    made = [i for i, images in enumerate(previews) if images is not None]
    if not made or not pipeline.moderates():
        return previews
    try:
        flags = pipeline.moderate([requests[i] for i in made], [previews[i] for i in made])  # type: ignore[misc]
    except Exception:
        logger.warning("the safety checker failed on previews; they are withheld", exc_info=True)
        return [None] * len(previews)
    kept = list(previews)
    for i, flag in zip(made, flags, strict=True):
        if flag:
            kept[i] = None
    if result is not None:
        result.moderations.append(ModerationRecord("preview", len(made), sum(flags)))
    return kept


def _checkable(request: GenerationRequest) -> bool:
    """Latents (`output_type="latent"`) are not pictures: there is nothing to check."""
    return request.params.output_type == "np"
