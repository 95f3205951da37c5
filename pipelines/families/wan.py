"""Wan 2.1: text-to-video and image-to-video, request-level and step-level, following
`WanPipeline.__call__`: UMT5 prompt embeddings (padded to `max_sequence_length`, so rows
concatenate), float32 video latents from each request's generators, a schedule of its own
(the pipeline's flow-matching UniPC by default), the transformer with a per-row timestep,
and classifier-free guidance above 1. A request's frames are part of its latent shape, so
of its step key.

Image-to-video (Wan 2.1 I2V), following `WanImageToVideoPipeline.__call__`: CLIP's image
embedding and the VAE latents of the first frame followed by zeros, with the first-frame
mask, made once per request; every step concatenates them to the noisy latents along the
channels. Wan 2.2's two-transformer checkpoints (`boundary_ratio`) and per-token
timesteps (`expand_timesteps`) are not stepped: they fall back to request-level batching.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import Sizes, video_sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, own_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.video import IMAGE_TO_VIDEO, TEXT_TO_VIDEO

# WanPipeline.__call__'s default: UMT5 embeddings are padded to this many tokens.
_MAX_SEQUENCE_LENGTH = 512
# Image-to-video conditioning, per row: first-frame latents with their mask, and CLIP's embedding.
_CONDITION = "condition"
_IMAGE_EMBEDS = "encoder_hidden_states_image"


class Wan(Family):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_VIDEO, "WanPipeline"),
        TaskUse(IMAGE_TO_VIDEO, "WanImageToVideoPipeline"),
    )
    key_name: ClassVar[str] = "wan"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 5.0
    default_fps: ClassVar[int] = 16
    default_num_frames: ClassVar[int] = 81
    sizes: ClassVar[Sizes] = video_sizes((832, 480), 16)

    def steps(self) -> bool:
        config = self.pipe.config
        return config.get("boundary_ratio") is None and not config.get("expand_timesteps", False)

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
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

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def scheduler(self, request: GenerationRequest) -> Any:
        steps = resolved(request.params.num_inference_steps)
        scheduler = own_scheduler(self.pipe.scheduler, steps, self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
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

    def image_to_video_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
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
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update({_CONDITION: condition, _IMAGE_EMBEDS: embeds})
        result: Tensor = latents
        return result

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        extra: dict[str, Tensor] = {}
        if _CONDITION in cond:  # image-to-video: the first frame's conditioning beside
            latents = torch.cat([latents, cond[_CONDITION]], dim=1)
            extra["encoder_hidden_states_image"] = cond[_IMAGE_EMBEDS]
        transformer = self.pipe.transformer
        out: Tensor = transformer(
            hidden_states=latents.to(transformer.dtype),
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
            **extra,
        )[0]
        return out

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        vae = pipe.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="np")
