"""FLUX Redux served beside a FLUX.1 model: a request's reference images become its text
conditioning.

`--ip-adapter NAME=SOURCE` with SOURCE a `FluxPriorReduxPipeline` (a hub id or directory such
as black-forest-labs/FLUX.1-Redux-dev, or the embedded `tiny-flux-redux`) rather than a
weights file serves a Redux prior, and a request's `ip_adapter` entries naming it are its
reference images, each at its `scale`. At prepare the prior runs as diffusers' two-stage
recipe runs it — `FluxPriorReduxPipeline(image=..., prompt=..., prompt_embeds_scale=scale,
pooled_prompt_embeds_scale=scale)`, with the served model's own text encoders, so the prompt's
T5 tokens come first and the images' SigLIP tokens follow, each image's share times its scale,
summed — and its `prompt_embeds` and `pooled_prompt_embeds` are the request's conditioning, as
`FluxPipeline(prompt_embeds=..., pooled_prompt_embeds=...)` takes them. Nothing changes in the
step: Redux rows are rows with other text embeddings.

Their text is longer than a plain prompt's (T5's 512 tokens, then one per SigLIP patch), and
FLUX's rows share their text positions and have no text mask, so Redux requests step together
(whatever their images and scales) but not with requests without Redux (`uses_redux` is in the
step key); and true CFG is refused (its negative rows would have the shorter text).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPriorReduxPipeline
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, IPAdapterRef, SamplingParams
from pipelines.tiny.redux import is_tiny_redux, tiny_redux_dir


def is_redux_source(source: str) -> bool:
    """Whether an `--ip-adapter` SOURCE names a Redux prior rather than IP-Adapter weights
    (always a file, `pipelines.ip_adapter.weights_location`): the tiny one, a local pipeline
    directory (its `model_index.json`), or a whole hub repository (`owner/repo`)."""
    if is_tiny_redux(source):
        return True
    path = Path(source)
    if path.is_dir():
        return (path / "model_index.json").is_file()
    return not path.exists() and source.count("/") == 1


@cache  # read at each request's step key; the sources are the model's, fixed at start
def redux_names(sources: tuple[tuple[str, str], ...]) -> frozenset[str]:
    """The names of the Redux priors among `--ip-adapter`'s (name, source) pairs."""
    return frozenset(name for name, source in sources if is_redux_source(source))


def uses_redux(refs: tuple[IPAdapterRef, ...], names: frozenset[str]) -> bool:
    return any(ref.name in names for ref in refs)


def check_redux_request(
    refs: tuple[IPAdapterRef, ...], params: SamplingParams, names: frozenset[str]
) -> None:
    """Refuse true CFG on a Redux request (400 naming `negative_prompt`): its negative rows'
    text (a plain prompt's) would not share the Redux rows' text positions in one forward."""
    if uses_redux(refs, names) and params.negative_prompt and (params.true_cfg_scale or 0) > 1:
        raise InvalidRequestError(
            "true CFG (a negative prompt with true_cfg_scale > 1) does not go with FLUX Redux "
            "reference images: drop the negative prompt or set true_cfg_scale to 1",
            "negative_prompt",
        )


class FluxRedux:
    """One Redux prior beside a FLUX.1 model, sharing the model's text encoders."""

    def __init__(self, name: str, prior: Any) -> None:
        self.name = name
        self.prior = prior

    @classmethod
    def load(cls, pipe: Any, name: str, source: str) -> FluxRedux:
        location = str(tiny_redux_dir(source)) if is_tiny_redux(source) else source
        prior = FluxPriorReduxPipeline.from_pretrained(
            location,
            text_encoder=pipe.text_encoder,
            tokenizer=pipe.tokenizer,
            text_encoder_2=pipe.text_encoder_2,
            tokenizer_2=pipe.tokenizer_2,
            dtype=pipe.transformer.dtype,
        )
        # Its own modules only: the text encoders are the model's, placed as its loader placed them.
        prior.image_encoder.to(pipe.transformer.device)
        prior.image_embedder.to(pipe.transformer.device)
        prior.set_progress_bar_config(disable=True)
        return cls(name, prior)

    @property
    def feature_extractor(self) -> Any:
        """SigLIP's image processor, which reduces reference images before they queue."""
        return self.prior.feature_extractor

    def conditioning(self, request: GenerationRequest) -> tuple[Tensor, Tensor]:
        """The request's `prompt_embeds` and `pooled_prompt_embeds`, one row each, from its
        prompt and its reference images at their scales."""
        refs = [ref for ref in request.ip_adapters if ref.name == self.name]
        scales = [float(ref.scale) for ref in refs]
        embeds: Tensor
        pooled: Tensor
        embeds, pooled = self.prior(
            image=[Image.fromarray(ref.image) for ref in refs],
            prompt=request.prompt,
            prompt_embeds_scale=scales,
            pooled_prompt_embeds_scale=scales,
            return_dict=False,
        )
        return embeds, pooled

    def rows(self, request: GenerationRequest, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """`conditioning`, one row per image of the request."""
        embeds, pooled = self.conditioning(request)
        return embeds.to(device).repeat(n, 1, 1), pooled.to(device).repeat(n, 1)
