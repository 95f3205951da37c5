"""Wan 2.1: text-to-video and image-to-video, request-level and step-level, following
`WanPipeline.__call__`: UMT5 prompt embeddings (padded to `max_sequence_length`, so rows
concatenate), float32 video latents from each request's generators, a schedule of its own
(the pipeline's flow-matching UniPC by default), the transformer with a per-row timestep,
and classifier-free guidance above 1. A request's frames are part of its latent shape, so
of its step key.

Image-to-video (Wan 2.1 I2V), following `WanImageToVideoPipeline.__call__`: CLIP's image
embedding and the VAE latents of the first frame followed by zeros, with the first-frame
mask, made once per request; every step concatenates them to the noisy latents along the
channels.

Wan 2.2 A14B (text- and image-to-video: `transformer_2` and `boundary_ratio` in the pipeline's
config): two experts, each request switching to the low-noise one at its own boundary step,
with `guidance_scale_2` after it (`pipelines.stepping.experts`); its image-to-video model has
no CLIP image encoder (the first frame's latents alone condition it). Wan 2.2 TI2V-5B
(`expand_timesteps`): the transformer takes a timestep per latent token, all of them the
step's for text-to-video. Its image-to-video (the same weights in `WanImageToVideoPipeline`,
chosen with `pipeline_class: pipelines.registry:WanImageToVideo`) keeps latent frame 0 at the
image's latents in every forward and before decoding, its tokens at timestep 0, through a
per-row frame mask: requests with different images share a step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import Sizes
from pipelines.loading import load_diffusers
from pipelines.outputs import resolved
from pipelines.stepping.experts import HIGH_NOISE, by_expert, expert_state
from pipelines.stepping.setup import encode_together, own_scheduler
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.video import IMAGE_TO_VIDEO, TEXT_TO_VIDEO

# WanPipeline.__call__'s default: UMT5 embeddings are padded to this many tokens.
_MAX_SEQUENCE_LENGTH = 512
# Image-to-video conditioning, per row: first-frame latents with their mask, and CLIP's embedding.
_CONDITION = "condition"
_IMAGE_EMBEDS = "encoder_hidden_states_image"
# TI2V image-to-video, per row: the image's latents (one frame) and the mask that is 0 on frame 0.
_FIRST_FRAME = "first_frame"
_FRAME_MASK = "frame_mask"


def _size_multiple(pipe: Any) -> int:
    """The VAE's spatial factor times the transformer's patch: 16 for Wan 2.1 and 2.2 A14B
    (8 x 2), 32 for TI2V-5B, whose VAE compresses 16x (diffusers resizes other sizes)."""
    transformer = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    return int(pipe.vae_scale_factor_spatial) * int(transformer.config.patch_size[1])


class Wan(Family):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_VIDEO, "WanPipeline"),
        TaskUse(IMAGE_TO_VIDEO, "WanImageToVideoPipeline"),
    )
    key_name: ClassVar[str] = "wan"
    splits_tokens: ClassVar[bool] = True
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 5.0
    default_fps: ClassVar[int] = 16
    default_num_frames: ClassVar[int] = 81
    sizes: ClassVar[Sizes] = Sizes(default=lambda pipe: (832, 480), multiple=_size_multiple)

    def steps(self) -> bool:
        return True

    @classmethod
    def load_pipe(cls, use: TaskUse, config: PipelineConfig) -> DiffusionPipeline:
        """As the model index says; TI2V-5B's weights (a `WanPipeline` directory) served for
        image-to-video run in `WanImageToVideoPipeline` over the components as loaded (the
        same weights, no image encoder: its `expand_timesteps` branch) — not through
        `from_pipe`, which casts them to float32 (`share_components`)."""
        run_as = "WanImageToVideoPipeline" if use.task is IMAGE_TO_VIDEO else None
        return load_diffusers(config, use.loader, run_as=run_as)

    def _per_token_timesteps(self) -> bool:
        return bool(self.pipe.config.get("expand_timesteps", False))

    def two_experts(self) -> bool:
        return self.pipe.config.get("boundary_ratio") is not None

    def cached_denoiser(self) -> torch.nn.Module | None:
        # Two experts split a group's rows between two transformers: diffusers' hooks on the
        # whole batch (request mode) would cache one of them.
        transformer: torch.nn.Module = self.pipe.transformer
        return None if self.two_experts() else transformer

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        # Step mode: each expert's forward is a phase of First-Block Cache (`by_expert`).
        return tuple(
            t for t in (self.pipe.transformer, getattr(self.pipe, "transformer_2", None)) if t is not None
        )

    def first_block_steps(self) -> bool:
        return True

    def step_denoiser(self, state: DenoiseState) -> torch.nn.Module:
        # The expert of the request's step (`_forward`'s), so its TaylorSeer series restarts
        # at its switch.
        expert = getattr(state, "expert", HIGH_NOISE)
        module: torch.nn.Module = self.pipe.transformer if expert == HIGH_NOISE else self.pipe.transformer_2
        return module

    def _boundary_timestep(self) -> float:
        ratio = float(self.pipe.config["boundary_ratio"])
        return ratio * float(self.pipe.scheduler.config.num_train_timesteps)

    def complete(self, params: SamplingParams) -> SamplingParams:
        if not self.two_experts() or params.guidance_scale_2 is not None:
            return params
        # diffusers' default is the request's own guidance scale; a preset may publish another.
        default = self.config.default_guidance_scale_2
        return replace(params, guidance_scale_2=params.guidance_scale if default is None else default)

    def key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return (params.guidance_scale_2,) if self.two_experts() else ()

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kwargs = super().call_kwargs(params)
        if self.two_experts():
            kwargs["guidance_scale_2"] = params.guidance_scale_2
        return kwargs

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
        conditions: Conditioning = {}
        # Only Wan 2.1's image-to-video transformer reads a CLIP embedding; 2.2 A14B has no
        # image encoder (diffusers checks `image_dim` the same way).
        if pipe.transformer.config.image_dim is not None:
            embeds = pipe.encode_image(image, device).repeat(n, 1, 1).to(pipe.transformer.dtype)
            conditions[_IMAGE_EMBEDS] = embeds
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
        with self.vae_lock:  # the VAE encodes the first frame; a decode may be running beside
            prepared = pipe.prepare_latents(
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
        if self._per_token_timesteps():
            # TI2V: the image's latents (one frame) replace latent frame 0, whose tokens sit at
            # timestep 0; the mask (0 on frame 0) gets one row per image, so rows concatenate.
            latents, first_frame, mask = prepared
            conditions.update({_FIRST_FRAME: first_frame, _FRAME_MASK: mask.expand(n, *mask.shape[1:])})
        else:
            latents, condition = prepared
            conditions[_CONDITION] = condition
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update(conditions)
        result: Tensor = latents
        return result

    def state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState:
        state = super().state(request, scheduler, latents, generators, prompts, first_step=first_step)
        if not self.two_experts():
            return state
        return expert_state(state, self._boundary_timestep(), resolved(request.params.guidance_scale_2))

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        # The plan cuts the video's tokens after the patch embedding (latent frames x
        # patches), with their rotary embedding and TI2V's per-token timesteps; not the text
        # (diffusers leaves it whole: Wan 2.1 I2V's 257 image tokens join it).
        frames = (resolved(params.num_frames) - 1) // self.frame_step() + 1
        side = _size_multiple(self.pipe)
        return {"video": frames * (resolved(params.height) // side) * (resolved(params.width) // side)}

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        if not self.two_experts():
            return self._forward(HIGH_NOISE, latents, timesteps, cond)
        return by_expert(states, latents, timesteps, cond, self._forward)

    def _forward(self, expert: int, latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """One forward of `expert` (the high-noise `transformer`, or `transformer_2`)."""
        extra: dict[str, Tensor] = {}
        if _CONDITION in cond:  # image-to-video: the first frame's conditioning beside
            latents = torch.cat([latents, cond[_CONDITION]], dim=1)
        if _IMAGE_EMBEDS in cond:
            extra[_IMAGE_EMBEDS] = cond[_IMAGE_EMBEDS]
        transformer = self.pipe.transformer if expert == HIGH_NOISE else self.pipe.transformer_2
        if self._per_token_timesteps():
            # TI2V: one timestep per latent token (F' x h/p x w/p): the row's, or 0 on an
            # image-to-video row's first frame, whose latents are the image's.
            _, patch_h, patch_w = transformer.config.patch_size
            if _FIRST_FRAME in cond:
                mask = cond[_FRAME_MASK]
                latents = (1 - mask) * cond[_FIRST_FRAME] + mask * latents
                timesteps = mask[:, 0, :, ::patch_h, ::patch_w].flatten(1) * timesteps[:, None]
            else:
                _, frames, height, width = latents.shape[1:]
                tokens = frames * (height // patch_h) * (width // patch_w)
                timesteps = timesteps[:, None].expand(-1, tokens)
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
        if any(_FIRST_FRAME in state.cond for state in states):
            latents = _with_first_frames(states, latents)
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="np")


def _with_first_frames(states: list[Any], latents: Tensor) -> Tensor:
    """TI2V image-to-video rows with latent frame 0 put back to their image's latents (the
    scheduler stepped it with the rest), as the stock call does before decoding."""
    rows, start = [], 0
    for state in states:
        part = latents[start : start + state.num_images]
        if _FIRST_FRAME in state.cond:
            mask = state.cond[_FRAME_MASK]
            part = (1 - mask) * state.cond[_FIRST_FRAME] + mask * part
        rows.append(part)
        start += state.num_images
    return torch.cat(rows)
