"""LTX-2: text-to-video with a stereo audio track, request-level and step-level, following
`LTX2Pipeline.__call__` with the defaults the request-level call leaves in place (read from
its signature: audio guidance 7, spatio-temporal guidance 1 at block 28, modality guidance 3,
rescale 0.7, for both modalities).

Step level: Gemma's hidden states through the text connectors (video and audio embeddings,
one mask; rows are independent, so every joiner's prompts go through together), video then
audio noise from each request's generators (the stock order), one schedule of its own
(sigmas 1 → 1/steps shifted by `mu` from the video's token count) that steps both latents
joined in one row (`pipelines.families.ltx2_guidance`). Each step is up to three transformer
forwards (`pipelines.families.ltx2_passes`), as in the stock loop: every row (negative and
positive), then the positive rows of the requests that use spatio-temporal guidance with those
blocks perturbed, then those of the requests that use modality guidance with audio-video
cross-attention off — each a pass over all its requests' rows, since the perturbed blocks
and the isolation are one argument per call. Each request is then guided in x0 space with its
own sigma and scales. The size, the frame count and the frame rate fix the video tokens, the
audio length, the positions and `mu`: they are the step key.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import latent_units
from pipelines.families.base import TaskUse
from pipelines.families.ltx import LTX
from pipelines.families.ltx2_guidance import Layout, LTX2State, Scales, isolates, perturbs
from pipelines.families.ltx2_passes import AUDIO_TEXT, TEXT_MASK, VIDEO_TEXT, StepPasses
from pipelines.families.policies import Sizes, video_sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, flow_scheduler
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.video import TEXT_TO_VIDEO

# A pipeline class's `__call__` defaults by argument, read once per class (steps read some).
_CALL_DEFAULTS: dict[type, dict[str, Any]] = {}


def _call_defaults(pipeline_class: type) -> dict[str, Any]:
    if pipeline_class not in _CALL_DEFAULTS:
        parameters = inspect.signature(pipeline_class.__call__).parameters.values()
        _CALL_DEFAULTS[pipeline_class] = {parameter.name: parameter.default for parameter in parameters}
    return _CALL_DEFAULTS[pipeline_class]


class LTX2(LTX):
    """LTX-2: video with a stereo audio track, returned per video in `extras["audio"]`
    (float32 (2, samples)) with its rate in `extras["sample_rate"]`, and muxed into the MP4."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(TEXT_TO_VIDEO, "LTX2Pipeline"),)
    key_name: ClassVar[str] = "ltx2"
    default_steps: ClassVar[int] = 30
    default_guidance_scale: ClassVar[float | None] = 3.0
    default_fps: ClassVar[int] = 24
    default_num_frames: ClassVar[int] = 121
    sizes: ClassVar[Sizes] = video_sizes((768, 512), 32)

    def extras_of(self, result: Any) -> dict[str, list[Any]]:
        return self._audio_extras(result.audio)

    def _audio_extras(self, tracks: Tensor) -> dict[str, list[Any]]:
        audio = [track.float().cpu().numpy() for track in tracks]
        rate = int(self.pipe.vocoder.config.output_sampling_rate)
        return {"audio": audio, "sample_rate": [rate] * len(audio)}

    def _default(self, name: str) -> Any:
        """The stock call's default for `name` (the request-level call passes no other)."""
        return _call_defaults(type(self.pipe))[name]

    def steps(self) -> bool:
        # Video and audio step as one row of one scheduler: right only for a scheduler whose
        # step is elementwise and draws nothing (`ltx2_guidance`). Another is served request-level.
        config = self.pipe.scheduler.config
        return config.get("_class_name") == "FlowMatchEulerDiscreteScheduler" and not config.get(
            "stochastic_sampling", False
        )

    def scales(self, params: SamplingParams) -> tuple[Scales, Scales]:
        """(video, audio) guidance of a request, as the stock call resolves them: the audio's
        own defaults, or the video's where those are unset."""
        video = Scales(
            resolved(params.guidance_scale),
            self._default("stg_scale"),
            self._default("modality_scale"),
            self._default("guidance_rescale"),
        )
        audio = Scales(
            self._default("audio_guidance_scale") or video.cfg,
            self._default("audio_stg_scale") or video.stg,
            self._default("audio_modality_scale") or video.modality,
            self._default("audio_guidance_rescale") or video.rescale,
        )
        return video, audio

    def uses_cfg(self, request: GenerationRequest) -> bool:
        # Either modality's scale above 1 (the audio's default, 7, is).
        video, audio = self.scales(request.params)
        return video.cfg > 1 or audio.cfg > 1

    def cached_denoiser(self) -> torch.nn.Module | None:
        return None  # diffusers' hooks lack its blocks (request mode); three forwards a step

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return (self.pipe.transformer,)

    def first_block_steps(self) -> bool:
        return True

    def passes(self, request: GenerationRequest) -> int:
        # The stock call's passes per step: with and without the prompt, then the positive
        # rows again with blocks perturbed (STG) and with audio-video attention cut.
        video, audio = self.scales(request.params)
        return super().passes(request) + int(perturbs(video, audio)) + int(isolates(video, audio))

    def context_tokens(self, request: GenerationRequest) -> int:
        # Each row's audio latents step beside its video ones (its audio stream attends to
        # them): the audio frames, in the budget's unit of one 8x8 latent pixel of a frame.
        layout = self.layout(request.params)
        return layout.audio_frames * latent_units(request.params) // max(1, layout.video_tokens)

    def layout(self, params: SamplingParams) -> Layout:
        pipe = self.pipe
        frames, height, width = self._latent_shape(params)
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        # As the stock call: the audio lasts as long as the video.
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length
        per_second /= float(pipe.audio_vae_temporal_compression_ratio)
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return Layout(
            frames=frames,
            height=height,
            width=width,
            video_tokens=(frames // patch_t) * (height // patch) * (width // patch),
            video_channels=pipe.transformer.config.in_channels * patch_t * patch * patch,
            audio_frames=round(resolved(params.num_frames) / resolved(params.fps) * per_second),
            audio_channels=pipe.audio_vae.config.latent_channels * mel_bins,
            mel_bins=mel_bins,
        )

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        pipe = self.pipe
        length = self._default("max_sequence_length")
        padding_side = getattr(getattr(pipe, "tokenizer", None), "padding_side", "left")

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, mask, _, _ = pipe.encode_prompt(
                prompt=texts,
                do_classifier_free_guidance=False,
                max_sequence_length=length,
                device=self.device,
            )
            video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=padding_side)
            return video, audio, connector_mask

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {VIDEO_TEXT: rows[0], AUDIO_TEXT: rows[1], TEXT_MASK: rows[2]}

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def scheduler(self, request: GenerationRequest) -> Any:
        config = self.pipe.scheduler.config
        # `mu` as the stock call computes it, with its own fallbacks for unset config fields.
        mu = calculate_shift(
            self.layout(request.params).video_tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        steps = resolved(request.params.num_inference_steps)
        return flow_scheduler(self.pipe.scheduler, steps, 0, self.device, mu=mu)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        """Video then audio noise from the request's generators (the stock order), joined."""
        pipe, params = self.pipe, request.params
        video = pipe.prepare_latents(
            batch_size=params.n,
            num_channels_latents=pipe.transformer.config.in_channels,
            height=resolved(params.height),
            width=resolved(params.width),
            num_frames=resolved(params.num_frames),
            dtype=torch.float32,
            device=self.device,
            generator=generators,
        )
        audio = pipe.prepare_audio_latents(
            batch_size=params.n,
            num_channels_latents=pipe.audio_vae.config.latent_channels,
            audio_latent_length=self.layout(params).audio_frames,
            num_mel_bins=pipe.audio_vae.config.mel_bins,
            dtype=torch.float32,
            device=self.device,
            generator=generators,
        )
        return Layout.join(video, audio)

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
        plain = super().state(request, scheduler, latents, generators, prompts, first_step=first_step)
        state = LTX2State(**{name: getattr(plain, name) for name in plain.__dataclass_fields__})
        state.video, state.audio = self.scales(request.params)
        return state

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """Up to three transformer passes, each positive row guided (`ltx2_passes`)."""
        layout = self.layout(states[0].request.params)
        return StepPasses(self.pipe, self._default, layout, states).denoise(latents, timesteps, cond)

    def guide(self, state: DenoiseState, uncond: Tensor, cond: Tensor) -> Tensor:
        return cond  # guided in `denoise`

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        layout = self.layout(states[0].request.params)
        video = pipe._unpack_latents(
            layout.split(latents)[0],
            layout.frames,
            layout.height,
            layout.width,
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        )
        video = video.to(states[0].cond[VIDEO_TEXT].dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            # As the stock call with its defaults (decode timestep 0, noise scale = timestep):
            # noise from each request's generators, weighted by the decode timestep.
            generators = [g for state in states for g in state.generators]
            noise = randn_tensor(video.shape, generator=generators, device=video.device, dtype=video.dtype)
            at = float(self._default("decode_timestep"))
            timestep = torch.full((video.shape[0],), at, device=video.device, dtype=video.dtype)
            scale = timestep[:, None, None, None, None]
            video = (1 - scale) * video + scale * noise
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(frames, output_type="np")

    def decode_extras(self, states: list[Any], latents: Tensor) -> dict[str, list[Any]]:
        """Each video's audio track: the audio latents through the audio VAE to a mel
        spectrogram, and the vocoder to a waveform, as the stock call."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        layout = self.layout(states[0].request.params)
        audio = layout.split(latents)[1]
        audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, layout.audio_frames, num_mel_bins=layout.mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return self._audio_extras(pipe.vocoder(mel))
