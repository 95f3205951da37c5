"""Wan VACE (`WanVACEPipeline`, Wan 2.1 VACE and Wan2.2-VACE-Fun-A14B): Wan's text-to-video
steered by a control video, its mask and reference images (`pipelines.tasks.control_video`),
following `WanVACEPipeline.__call__`.

Everything but the conditioning is Wan's (`pipelines.families.wan`): UMT5 prompts, float32
noise, the flow-matching UniPC, two experts split at `boundary_ratio` where the weights have
them. The conditioning, made once per request with the pipeline's own methods: the control
video split by the binarized mask into the part kept and the part redrawn, each VAE-encoded
(the mode: the generators draw only the noise), the mask folded 8x8 into channels, and each
reference's latents in front as extra frames: a (96, F' + refs, h, w) tensor the transformer's
VACE blocks read beside the noisy latents, the same for the request's negative rows. The noise
covers the references' frames too; decoding drops them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.families.base import TaskUse
from pipelines.families.wan import Wan
from pipelines.outputs import resolved
from pipelines.stepping.experts import HIGH_NOISE
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.control_video import CONTROL_VIDEO, call_inputs

_CONTROL = "control_hidden_states"
# Per row, one `conditioning_scale` per VACE layer (the request's, as diffusers repeats a float).
_SCALE = "control_hidden_states_scale"


class WanVACE(Wan):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        # diffusers refuses lists of prompts and generators here: one request per call.
        TaskUse(CONTROL_VIDEO, "WanVACEPipeline", name="WanVACE", one_image_per_call=True),
    )
    key_name: ClassVar[str] = "wan-vace"

    def cached_denoiser(self) -> torch.nn.Module | None:
        # VACE adds each request's control hints between blocks for every row; the cache's
        # "rest" blocks run the computing rows only, so the hints would not line up.
        return None

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return ()  # nor in step mode, with one expert or two (`cached_denoiser`)

    def first_block_steps(self) -> bool:
        return False

    def _transformer(self) -> Any:
        return self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2

    def call_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """One prompt, negative prompt and generator, not lists of one (diffusers refuses lists)."""
        return {name: value[0] if isinstance(value, list) else value for name, value in inputs.items()}

    def control_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """The request's noise (its references' frames included), its conditioning put into
        both of its conditionings, one row per image."""
        pipe, params, device = self.pipe, request.params, self.device
        n, width, height = params.n, resolved(params.width), resolved(params.height)
        frames = resolved(params.num_frames)
        inputs = call_inputs(request)
        video, mask, references = pipe.preprocess_conditions(
            inputs.get("video"),
            inputs.get("mask"),
            inputs.get("reference_images"),
            1,
            height,
            width,
            frames,
            torch.float32,
            device,
        )
        with self.vae_lock:  # the VAE encodes the control video; a decode may be running beside
            latents = pipe.prepare_video_latents(video, mask, references, None, device)
        control = torch.cat([latents, pipe.prepare_masks(mask, references, None)], dim=1)
        transformer = self._transformer()
        control = control.to(transformer.dtype).expand(n, *control.shape[1:])
        layers = len(transformer.config.vace_layers)
        scale = torch.full(
            (n, layers), resolved(params.conditioning_scale), device=device, dtype=transformer.dtype
        )
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update({_CONTROL: control, _SCALE: scale})
        noise: Tensor = pipe.prepare_latents(
            n,
            self._transformer().config.in_channels,
            height,
            width,
            frames + len(references[0]) * self.frame_step(),
            torch.float32,
            device,
            generators,
        )
        return noise

    def _forward(self, expert: int, latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        transformer = self.pipe.transformer if expert == HIGH_NOISE else self.pipe.transformer_2
        # (layers, rows, 1, 1): the transformer takes one entry per layer, which broadcasts
        # over each row's hidden states (rows, tokens, width).
        scale = cond[_SCALE].transpose(0, 1)[:, :, None, None]
        out: Tensor = transformer(
            hidden_states=latents.to(transformer.dtype),
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            control_hidden_states=cond[_CONTROL],
            control_hidden_states_scale=scale,
            return_dict=False,
        )[0]
        return out

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        # The references' latent frames lead every row (one count per step key).
        references = len(states[0].request.input_images)
        return super().decode(states, latents[:, :, references:])
