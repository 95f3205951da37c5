"""LTX-2's denoiser step: the stock loop's transformer passes over a step group's joined rows
and each request's row guided from them (`LTX2.denoise` runs `StepPasses.denoise`).

Up to three forwards a step, as `LTX2Pipeline.__call__` runs them: every row (negative and
positive), then the positive rows of the requests that use spatio-temporal guidance with
those blocks perturbed, then those of the requests that use modality guidance with audio-video
cross-attention off. It is the one part of the family that calls the transformer and the
largest, so it lives apart from the family's other stages (`pipelines.families.ltx2`), as the
latent row and the guidance do (`pipelines.families.ltx2_guidance`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate
from torch import Tensor

from pipelines.cache.calls import denoiser_call
from pipelines.families.ltx2_guidance import Layout, LTX2State, guided_row
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning

# A request's conditioning: the text connectors' video and audio embeddings, one mask.
VIDEO_TEXT = "encoder_hidden_states"
AUDIO_TEXT = "audio_encoder_hidden_states"
TEXT_MASK = "encoder_attention_mask"

# The stock call's default for an argument, by name (`LTX2._default`): passed in, not read
# here, so a family (a test) that changes its defaults changes its passes too.
CallDefault = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class StepPasses:
    """One step group's passes: its pipeline, the stock call's defaults, its latent layout
    (one for the group: the step key fixes it) and its requests' states, merged in order."""

    pipe: DiffusionPipeline
    default: CallDefault
    layout: Layout
    states: list[Any]

    def denoise(self, latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """Every row's velocity, each positive row already guided (the family's `guide` passes
        it on): the guidance reads the extra passes' predictions, and applies even to a
        request without negative rows."""
        # Each pass is its own kind of forward for First-Block Cache: a request's residuals
        # of one are compared with that pass's only.
        with denoiser_call(kind="main"):
            main = self._forward(latents, timesteps, cond)
        positive, offset = [], 0
        for state in self.states:
            start = offset + (0 if state.uncond is None else state.num_images)
            positive.append(range(start, start + state.num_images))
            offset += state.rows

        def extra_pass(kind: str, wants: Callable[[LTX2State], bool], **kwargs: Any) -> dict[int, Tensor]:
            """The predictions (joined) of one guidance pass over the positive rows of the
            states that want it, by row of the merged batch."""
            rows = [
                row for state, own in zip(self.states, positive, strict=True) if wants(state) for row in own
            ]
            if not rows:
                return {}
            index = torch.tensor(rows, device=latents.device)
            part = {name: value.index_select(0, index) for name, value in cond.items()}
            picked, times = latents.index_select(0, index), timesteps.index_select(0, index)
            with denoiser_call(rows, kind=kind):
                predicted = self._forward(picked, times, part, **kwargs)
            return dict(zip(rows, predicted, strict=True))

        blocks = self.default("spatio_temporal_guidance_blocks")
        perturbed = extra_pass("perturbed", lambda state: state.perturbs, blocks=blocks)
        isolated = extra_pass("isolated", lambda state: state.isolates, isolate=True)
        parts: list[Tensor] = []
        for state, rows in zip(self.states, positive, strict=True):
            n = state.num_images
            uncond = None if state.uncond is None else main[rows.start - n : rows.start]
            if uncond is not None:
                parts.append(uncond)
            passes = [
                main[rows.start : rows.stop],
                uncond,
                torch.stack([perturbed[row] for row in rows]) if state.perturbs else None,
                torch.stack([isolated[row] for row in rows]) if state.isolates else None,
            ]
            parts.append(guided_row(self.pipe, self.layout, state, passes))
        return torch.cat(parts)

    def _forward(
        self,
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
        *,
        blocks: list[int] | None = None,
        isolate: bool = False,
    ) -> Tensor:
        """One transformer forward over joined rows, each at its own timestep: the video and
        audio velocities, joined, in float32."""
        layout, params = self.layout, self.states[0].request.params
        transformer, text = self.pipe.transformer, cond[VIDEO_TEXT]
        rows, device = latents.shape[0], latents.device
        fps = conditioning_frame_rate(resolved(params.fps), self.default("motion_speed"))
        video, audio = layout.split(latents)
        mask = cond[TEXT_MASK]
        video_out, audio_out = transformer(
            hidden_states=video.to(text.dtype),
            audio_hidden_states=audio.to(text.dtype),
            encoder_hidden_states=text,
            audio_encoder_hidden_states=cond[AUDIO_TEXT],
            timestep=timesteps,
            sigma=timesteps,  # as the stock call (LTX-2.3 reads it)
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=layout.frames,
            height=layout.height,
            width=layout.width,
            fps=fps,
            audio_num_frames=layout.audio_frames,
            video_coords=transformer.rope.prepare_video_coords(
                rows, layout.frames, layout.height, layout.width, device, fps=fps
            ),
            audio_coords=transformer.audio_rope.prepare_audio_coords(rows, layout.audio_frames, device),
            isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=blocks,
            perturbation_mask=None,
            use_cross_timestep=self.default("use_cross_timestep"),
            return_dict=False,
        )
        return Layout.join(video_out.float(), audio_out.float())
