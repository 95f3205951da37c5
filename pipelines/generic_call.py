"""What a diffusers pipeline's `__call__` accepts, read from its signature at start.

The generic adapter (`pipelines.generic`) serves pipeline classes no family file knows, so
it cannot assume diffusers' usual arguments: it reads which of them the call takes, whether
its type hints admit lists (one call for several requests), and its defaults (steps,
guidance, size). A class whose call needs what a text-to-image request does not bring (an
input image, image embeddings) or makes video is refused, with the reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Required arguments a text-to-image request cannot fill.
_PROMPT = "prompt"
# Arguments that say the pipeline wants more than a prompt (an input image, a video length).
_NOT_TEXT_TO_IMAGE = {
    "image": "it takes an input image",
    "images": "it takes input images",
    "mask_image": "it takes a mask",
    "control_image": "it takes a control image",
    "num_frames": "it makes video",
    "audio_length_in_s": "it makes audio",
}


def _admits_list(parameter: inspect.Parameter) -> bool:
    """Whether the type hint admits a list: diffusers writes `str | list[str]` (or `Union[str,
    List[str]]`) where a call takes one value per prompt. No hint: assume not, and call once
    per request (always correct, only slower)."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return False
    return "list" in str(annotation).lower()


@dataclass(frozen=True, slots=True)
class CallSignature:
    """The arguments of one diffusers `__call__` the generic adapter may pass."""

    class_name: str
    parameters: frozenset[str]
    prompt_lists: bool = False
    negative_prompt_lists: bool = False
    generator_lists: bool = False
    # The call's own defaults of num_inference_steps, guidance_scale, height and width.
    defaults: dict[str, Any] = field(default_factory=dict)
    # Why a text-to-image request cannot run through this call, or None.
    refusal: str | None = None

    @classmethod
    def of(cls, pipeline_class: type) -> CallSignature:
        call = inspect.signature(pipeline_class.__call__).parameters
        names = frozenset(name for name in call if name != "self")
        defaults = {
            name: call[name].default
            for name in ("num_inference_steps", "guidance_scale", "height", "width")
            if name in call and call[name].default is not inspect.Parameter.empty
        }
        return cls(
            class_name=pipeline_class.__name__,
            parameters=names,
            prompt_lists=_PROMPT in call and _admits_list(call[_PROMPT]),
            negative_prompt_lists="negative_prompt" in call and _admits_list(call["negative_prompt"]),
            generator_lists="generator" in call and _admits_list(call["generator"]),
            defaults=defaults,
            refusal=_refusal(call),
        )

    def accepts(self, name: str) -> bool:
        return name in self.parameters

    @property
    def batches(self) -> bool:
        """Several requests in one call: a list of prompts with one generator per image (a
        request's own seed must give its own image, whoever shares the call)."""
        return self.prompt_lists and self.generator_lists

    def describe(self) -> str:
        """The log line's account of how requests are batched, and why."""
        if self.batches:
            how = "batches requests through prompt lists (one generator per image)"
        else:
            missing = [
                what
                for what, ok in (
                    ("prompt lists", self.prompt_lists),
                    ("generator lists", self.generator_lists),
                )
                if not ok
            ]
            how = f"runs one request per forward (its call takes no {' or '.join(missing)})"
        if self.accepts("negative_prompt") and not self.negative_prompt_lists:
            how += "; the negative prompt is one string per call, so it is in the batch key"
        return how


def _refusal(call: Mapping[str, inspect.Parameter]) -> str | None:
    if _PROMPT not in call:
        return "its call takes no prompt"
    if "generator" not in call:
        return "its call takes no generator, so a seed could not reproduce an image"
    for name, why in _NOT_TEXT_TO_IMAGE.items():
        if name in call:
            return f"{why} ({name!r}); the generic adapter serves text-to-image"
    required = [
        p.name
        for p in call.values()
        if p.name not in ("self", _PROMPT, "generator")
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        return f"its call requires {', '.join(required)}, which a text-to-image request does not bring"
    return None
