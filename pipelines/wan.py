"""Wan 2.1: its request-level adapters (text-to-video, and image-to-video on top) and its own
denoising loop in stages for step-level batching, following `WanPipeline.__call__`: UMT5
prompt embeddings (padded to `max_sequence_length`, so rows concatenate), float32 video
latents from each request's generators, a schedule of its own (the pipeline's flow-matching
UniPC by default), the transformer with a per-row timestep, and classifier-free guidance
above 1. A request's frames are part of its latent shape, so of its step key.

Image-to-video (Wan 2.1 I2V) steps too, with its image conditioning per request. Wan 2.2's
two-transformer checkpoints (`boundary_ratio`) and per-token timesteps (`expand_timesteps`)
are not stepped: those pipelines fall back to request-level batching.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from engine.request import BatchKey, GenerationRequest, RequestBatch
from pipelines.inputs import reduce_image
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, generators_for, own_scheduler
from pipelines.stepping.stages import SteppedStages
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.text_to_video import DiffusersTextToVideo

# WanPipeline.__call__'s default: UMT5 embeddings are padded to this many tokens.
_MAX_SEQUENCE_LENGTH = 512


class WanTextToVideo(SteppedStages, DiffusersTextToVideo):
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 5.0
    default_fps: ClassVar[int] = 16
    default_num_frames: ClassVar[int] = 81
    default_video_size: ClassVar[tuple[int, int]] = (832, 480)
    video_size_multiple: ClassVar[int] = 16

    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        config = self.pipe.config
        return config.get("boundary_ratio") is None and not config.get("expand_timesteps", False)

    def step_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return ("wan", params.width, params.height, params.num_frames, params.output_type, params.lora)

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        dtype = self.pipe.transformer.dtype

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _ = self.pipe.encode_prompt(
                prompt=texts,
                do_classifier_free_guidance=False,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
                device=self.device,
            )
            return (embeds.to(dtype),)

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {"encoder_hidden_states": rows[0]}

        return encode_together(requests, self._uses_cfg, encode, conditioning)

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        pipe, params = self.pipe, request.params
        device = self.device
        generators = generators_for(request)
        latents = self._initial_latents(request, generators, cond, uncond)
        scheduler = own_scheduler(pipe.scheduler, resolved(params.num_inference_steps), device)
        scheduler.set_begin_index(0)
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=(cond, uncond),
            guidance_scale=resolved(params.guidance_scale),
            generators=generators,
        )

    def _initial_latents(
        self,
        request: GenerationRequest,
        generators: list[torch.Generator],
        cond: Conditioning,
        uncond: Conditioning | None,
    ) -> Tensor:
        """The request's float32 video noise, from its own generators."""
        pipe, params = self.pipe, request.params
        latents: Tensor = pipe.prepare_latents(
            params.n,
            pipe.transformer.config.in_channels,
            resolved(params.height),
            resolved(params.width),
            resolved(params.num_frames),
            torch.float32,
            self.device,
            generators,
        )
        return latents

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        return self._transformer(latents, timesteps, cond)

    def _transformer(self, hidden: Tensor, timesteps: Tensor, cond: Conditioning, **extra: Tensor) -> Tensor:
        transformer = self.pipe.transformer
        out: Tensor = transformer(
            hidden_states=hidden.to(transformer.dtype),
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
            **extra,
        )[0]
        return out

    def _decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        vae = pipe.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="np")


# The side of the image Wan 2.1 I2V's CLIP image encoder sees.
_CLIP_SIDE = 224
# Image-to-video conditioning, per row: first-frame latents with their mask, and CLIP's embedding.
_CONDITION = "condition"
_IMAGE_EMBEDS = "encoder_hidden_states_image"


class WanImageToVideo(WanTextToVideo):
    """Wan image-to-video: the request's input image is the first frame's reference.

    diffusers takes one image per call, shared by every prompt, so request-level batching
    shares a forward only between identical input images (a digest of the pixels is in the
    key). Step-level, each request carries its own image, following
    `WanImageToVideoPipeline.__call__` (Wan 2.1): CLIP's image embedding and the VAE latents
    of the first frame followed by zeros, with the first-frame mask, computed once at
    prepare; every step concatenates them to the noisy latents along the channels. So any
    input images share a step; the key stays the video's shape.
    """

    input_image_count: ClassVar[tuple[int, int]] = (1, 1)

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        """The pipeline uses the image at the video's size (VAE) and at 224x224 (CLIP): a
        4096x4096 upload need not wait in the queue at full size. Reduced, aspect kept, to
        twice what either path needs, so their own resizing still starts from more pixels
        than it keeps (the output moves by resampling noise only)."""
        image = request.input_images[0]
        width, height = resolved(request.params.width), resolved(request.params.height)
        reduced = reduce_image(image, 2 * width, 2 * height, min_side=2 * _CLIP_SIDE)
        return request if reduced is image else replace(request, input_images=(reduced,))

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        image = request.input_images[0]
        digest = request.input_digest or hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()
        return (*super().batch_key(request), image.shape, digest)

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        return {"image": Image.fromarray(batch.requests[0].input_images[0])}

    def _initial_latents(
        self,
        request: GenerationRequest,
        generators: list[torch.Generator],
        cond: Conditioning,
        uncond: Conditioning | None,
    ) -> Tensor:
        """The noise, and the image's conditioning (CLIP embedding; first-frame latents and
        mask, from the VAE's mode, so the generators draw only the noise) in both rows."""
        pipe, params = self.pipe, request.params
        device, n = self.device, params.n
        width, height = resolved(params.width), resolved(params.height)
        image = Image.fromarray(request.input_images[0])
        embeds = pipe.encode_image(image, device).repeat(n, 1, 1).to(pipe.transformer.dtype)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
        with self.vae_lock:  # the VAE encodes the first frame; a decode may be running beside
            latents, condition = pipe.prepare_latents(
                pixels,
                n,
                pipe.vae.config.z_dim,
                height,
                width,
                resolved(params.num_frames),
                torch.float32,
                device,
                generators,
            )
        for conditioning in (cond, uncond):
            if conditioning is not None:
                conditioning.update({_CONDITION: condition, _IMAGE_EMBEDS: embeds})
        result: Tensor = latents
        return result

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        hidden = torch.cat([latents, cond[_CONDITION]], dim=1)
        return self._transformer(hidden, timesteps, cond, encoder_hidden_states_image=cond[_IMAGE_EMBEDS])
