"""LTX-Video: text-to-video, request-level and step-level, following `LTXPipeline.__call__`:
T5 embeddings with attention masks (padded to `max_sequence_length`, so rows concatenate),
packed float32 video latents from each request's generators, its own flow-matching schedule
(sigmas 1 → 1/steps shifted by `mu` from the video's token count), the transformer with
per-row timesteps and RoPE scaled by the frame rate (so the frame rate is in both keys and
in the call), CFG above 1, and the VAE tail with its timestep conditioning. LTX-2, its
subclass with audio, is `pipelines.families.ltx2`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import Sizes, video_sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, flow_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.video import TEXT_TO_VIDEO

# LTXPipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 128


class LTX(Family):
    """LTX-Video: the frame rate scales the transformer's temporal positions, so it is part
    of the call and of the batch key."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(TEXT_TO_VIDEO, "LTXPipeline"),)
    key_name: ClassVar[str] = "ltx"
    splits_tokens: ClassVar[bool] = True
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 3.0
    default_fps: ClassVar[int] = 25
    default_num_frames: ClassVar[int] = 161
    sizes: ClassVar[Sizes] = video_sizes((704, 512), 32)
    flow_matching: ClassVar[bool] = True

    def frame_step(self) -> int:
        return int(self.pipe.vae_temporal_compression_ratio)

    def validate(self, params: SamplingParams) -> None:
        # One step gives sigma 1.0 with LTX's terminal shift: 0/0 in diffusers, NaN frames.
        if resolved(params.num_inference_steps) < 2:
            raise InvalidRequestError(
                "num_inference_steps must be at least 2 for LTX-Video", "num_inference_steps"
            )

    def key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return (params.fps,)

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {**super().call_kwargs(params), "frame_rate": params.fps}

    def cached_denoiser(self) -> torch.nn.Module | None:
        # One forward per step with every row; diffusers' hooks know its blocks (request mode).
        transformer: torch.nn.Module = self.pipe.transformer
        return transformer

    def steps(self) -> bool:
        return True

    def step_key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return (params.fps,)

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, mask, _, _ = self.pipe.encode_prompt(
                prompt=texts,
                do_classifier_free_guidance=False,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
                device=self.device,
            )
            return embeds, mask

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {"encoder_hidden_states": rows[0], "encoder_attention_mask": rows[1]}

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def _latent_shape(self, params: SamplingParams) -> tuple[int, int, int]:
        pipe = self.pipe
        frames = (resolved(params.num_frames) - 1) // pipe.vae_temporal_compression_ratio + 1
        spatial = pipe.vae_spatial_compression_ratio
        return frames, resolved(params.height) // spatial, resolved(params.width) // spatial

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        # The plan cuts the text (T5 padded to `_MAX_SEQUENCE_LENGTH`) with its mask, and the
        # video's tokens (one per latent voxel: patch size 1) with their rotary embedding.
        frames, height, width = self._latent_shape(params)
        pipe = self.pipe
        spatial, temporal = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        video = (frames // temporal) * (height // spatial) * (width // spatial)
        return {"text": _MAX_SEQUENCE_LENGTH, "video": video}

    def scheduler(self, request: GenerationRequest) -> Any:
        frames, height, width = self._latent_shape(request.params)
        steps = resolved(request.params.num_inference_steps)
        return flow_scheduler(self.pipe.scheduler, steps, frames * height * width, self.device)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
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

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        pipe, params = self.pipe, states[0].request.params
        frames, height, width = self._latent_shape(params)
        spatial, temporal = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        text = cond["encoder_hidden_states"]
        out: Tensor = pipe.transformer(
            hidden_states=latents.to(text.dtype),
            encoder_hidden_states=text,
            timestep=timesteps,
            encoder_attention_mask=cond["encoder_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            # The frame rate scales the temporal positions: it is in the step key.
            rope_interpolation_scale=(temporal / resolved(params.fps), spatial, spatial),
            return_dict=False,
        )[0]
        return out.float()

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, params = self.pipe, states[0].request.params
        vae = pipe.vae
        frames, height, width = self._latent_shape(params)
        latents = pipe._unpack_latents(
            latents,
            frames,
            height,
            width,
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        )
        latents = pipe._denormalize_latents(
            latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
        latents = latents.to(states[0].cond["encoder_hidden_states"].dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            # As the stock call with its defaults (decode_timestep 0, noise scale 0): the
            # noise is drawn from each request's generators and weighted by zero.
            generators = [g for state in states for g in state.generators]
            noise = randn_tensor(
                latents.shape, generator=generators, device=latents.device, dtype=latents.dtype
            )
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
            scale = timestep[:, None, None, None, None]
            latents = (1 - scale) * latents + scale * noise
        video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="np")
