"""Qwen-Image: text-to-image, image-to-image, inpainting (its text-to-image weights through
`QwenImageImg2ImgPipeline` and `QwenImageInpaintPipeline`) and the reference edits of
Qwen-Image-Edit and -Edit-Plus (2509, 2511: one to three images), request-level and
step-level (Edit-Plus one request per call request-level: diffusers refuses batches).

The stages follow `QwenImagePipeline.__call__`: the prompt through the chat template and
Qwen2.5-VL, packed latents from each request's generators, a flow-matching schedule of its
own (sigmas 1 → 1/steps, shifted by `mu` from the image's token count), the transformer
with a per-row timestep / 1000, and true CFG with the per-row norm rescale, for requests
that have a negative prompt and a true CFG scale above 1.

Prompts differ in length: a step pads every request's text to the group's longest with a
zero mask, which the transformer honours, so rows of any prompt length share a forward.
Its VAE is a video VAE: an input image goes in, and its latents come out, as one frame.
Text-to-image takes ControlNets (`pipelines.controlnet_qwen`: their residuals go into the
transformer's forward, per row).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines import qwen_edit_plus
from pipelines.controlnet_qwen import QwenImageControlNets
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import PATCHIFIED, TRUE_CFG, Guidance, Sizes
from pipelines.outputs import resolved
from pipelines.qwen_edit_loading import load_qwen_image_edit
from pipelines.stepping.setup import (
    encode_together,
    guidance_rows,
    packed_flow_scheduler,
    packed_mask,
    packed_size,
)
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING
from pipelines.tasks.multi_reference_edit import MULTI_REFERENCE_EDIT
from pipelines.tasks.reference_edit import IMAGE_LATENTS, REFERENCE_EDIT, condition_image, condition_size

_TEXT = "encoder_hidden_states"
_MASK = "encoder_hidden_states_mask"
# QwenImagePipeline.__call__'s default.
_MAX_SEQUENCE_LENGTH = 512


class QwenImage(Family):
    """Qwen-Image: true CFG scale 4 by default, applied when a request has a negative prompt;
    `guidance_scale` matters only for guidance-distilled checkpoints."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "QwenImagePipeline"),
        TaskUse(IMAGE_TO_IMAGE, "QwenImageImg2ImgPipeline"),
        TaskUse(INPAINTING, "QwenImageInpaintPipeline"),
        TaskUse(REFERENCE_EDIT, "QwenImageEditPipeline", name="QwenImageEdit", loader=load_qwen_image_edit),
        # 2509 and 2511 (whose transformer modulates the references at timestep 0, from
        # `img_shapes`): 1 to 3 input images per request, "optimal" per the model cards.
        # diffusers refuses batches of prompts: one image per call request-level; our own
        # steps batch requests whose references share their sizes.
        TaskUse(
            MULTI_REFERENCE_EDIT,
            "QwenImageEditPlusPipeline",
            name="QwenImageEditPlus",
            images=(1, 3),
            request_batch=False,
            one_image_per_call=True,
            loader=load_qwen_image_edit,
        ),
    )
    key_name: ClassVar[str] = "qwen-image"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = None
    default_true_cfg_scale: ClassVar[float | None] = 4.0
    guidance: ClassVar[Guidance] = TRUE_CFG
    splits_tokens: ClassVar[bool] = True
    sizes: ClassVar[Sizes] = PATCHIFIED
    flow_matching: ClassVar[bool] = True
    # diffusers 0.42.1's `QwenEmbedRope` takes one image shape for the batch (it warns and
    # uses the first for mixed `img_shapes`) and starts the text's positions after the
    # image's largest half-side, so a shared grid moves each row's text; and its attention
    # processor refuses any mask but the text's. Mixing would need a processor of our own.
    mixes_sizes_why: ClassVar[str] = (
        "diffusers' rotary embedding takes one image shape per batch and places the text after it"
    )
    controlnets: QwenImageControlNets | None

    def validate(self, params: SamplingParams) -> None:
        # One step gives sigma 1.0 with Qwen-Image's terminal shift: 0/0 in diffusers, NaN images.
        if resolved(params.num_inference_steps) < 2:
            raise InvalidRequestError(
                "num_inference_steps must be at least 2 for Qwen-Image", "num_inference_steps"
            )

    def steps(self) -> bool:
        return True

    def cached_denoiser(self) -> torch.nn.Module | None:
        # Qwen-Image-Edit-2511's `zero_cond_t` doubles the timestep rows inside the forward
        # (the references' at 0), which the per-row cut does not follow: not cached.
        transformer: torch.nn.Module = self.pipe.transformer
        return None if self.pipe.transformer.config.get("zero_cond_t") else transformer

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            """Prompt embeddings and their mask, one row per text."""
            if task is MULTI_REFERENCE_EDIT:
                return self._encode_with_references(texts, owners)
            embeds, mask = self.pipe.encode_prompt(
                texts,
                device=self.device,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
                **task.prompt_inputs(self, owners),
            )
            if mask is None:  # diffusers drops a mask that is all ones
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return embeds, mask

        return encode_together(requests, self.uses_cfg, encode, lambda r, rows: self._conditioning(r, *rows))

    def _encode_with_references(
        self, texts: list[str], owners: list[GenerationRequest]
    ) -> tuple[Tensor, ...]:
        """Edit Plus: each text read with its own request's images (resized once per request)."""
        resized = {r.request_id: qwen_edit_plus.condition_images(self.pipe, r.input_images) for r in owners}
        images = [resized[r.request_id] for r in owners]
        return qwen_edit_plus.prompt_embeds(self.pipe, texts, images, self.device)

    def _conditioning(self, request: GenerationRequest, embeds: Tensor, mask: Tensor) -> Conditioning:
        length = int(mask.sum(dim=1).max())  # this request's own text, without the batch's padding
        cond = {_TEXT: embeds[:, :length], _MASK: mask[:, :length]}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = guidance_rows(embeds, resolved(request.params.guidance_scale))
        return cond

    def scheduler(self, request: GenerationRequest) -> Any:
        return packed_flow_scheduler(self.pipe, request, self.device)

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
            pipe.transformer.config.in_channels // 4,
            resolved(params.height),
            resolved(params.width),
            cond[_TEXT].dtype,
            self.device,
            generators,
        )
        return latents

    def reference_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """The noise, and the input images' packed VAE latents, one after the other, into both
        conditionings (the VAE takes its mode, so the generators only draw the noise, as in
        diffusers)."""
        pipe, params = self.pipe, request.params
        cond, uncond = prompts
        images: Tensor | list[Tensor]
        if self.use.task is MULTI_REFERENCE_EDIT:
            images = qwen_edit_plus.vae_pixels(pipe, request.input_images)
        else:
            width, height = condition_size(request.input_images[0])
            image = condition_image(self, request)
            images = pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        with self.vae_lock:  # the VAE encodes the images; a decode may be running beside
            latents, image_latents = pipe.prepare_latents(
                images,
                params.n,
                pipe.transformer.config.in_channels // 4,
                resolved(params.height),
                resolved(params.width),
                cond[_TEXT].dtype,
                self.device,
                generators,
            )
        for conditioning in (cond, uncond):
            if conditioning is not None:
                conditioning[IMAGE_LATENTS] = image_latents
        result: Tensor = latents
        return result

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        if self.use.task is MULTI_REFERENCE_EDIT:
            return qwen_edit_plus.reference_sizes(request.input_images)
        return (condition_size(request.input_images[0]),)

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        # The plan cuts `hidden_states` and the rotary embedding's image part: one token per
        # 2x2 patch of latents. The text (its length is the longest prompt's) is padded to a
        # multiple of the degree in `denoise`, under its mask.
        side = self.pipe.vae_scale_factor * 2
        return {"image": (resolved(params.height) // side) * (resolved(params.width) // side)}

    def reference_tokens(self, request: GenerationRequest) -> int:
        if self.use.task not in (REFERENCE_EDIT, MULTI_REFERENCE_EDIT):
            return 0  # image-to-image and inpainting: the input is the latents' start, not tokens
        side = self.pipe.vae_scale_factor * 2
        return sum((width // side) * (height // side) for width, height in self.reference_sizes(request))

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        return qwen_edit_plus.output_size(request.input_images, self.pipe.vae_scale_factor * 2)

    def merge(self, conds: list[Conditioning]) -> Conditioning:
        """Pad every request's text to the longest in the group; the mask hides the padding."""
        longest = max(cond[_TEXT].shape[1] for cond in conds)

        def padded(tensor: Tensor) -> Tensor:
            missing = longest - tensor.shape[1]
            if missing == 0:
                return tensor
            pad = tensor.new_zeros((tensor.shape[0], missing, *tensor.shape[2:]))
            return torch.cat([tensor, pad], dim=1)

        text = (_TEXT, _MASK)
        return {
            name: torch.cat([padded(c[name]) if name in text else c[name] for c in conds])
            for name in conds[0]
        }

    def guide(self, state: DenoiseState, uncond: Tensor, cond: Tensor) -> Tensor:
        combined = uncond + state.guidance_scale * (cond - uncond)
        # Qwen-Image keeps each token's norm of the conditional prediction.
        kept: Tensor = torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
        return combined * kept

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The transformer over the rows; an edit's rows carry their references' tokens after
        their own (after theirs in `img_shapes`, which 2511's transformer also reads to
        modulate the references at timestep 0), and keep the prediction for their own only."""
        request = states[0].request
        side = self.pipe.vae_scale_factor * 2
        shapes = [(1, resolved(request.params.height) // side, resolved(request.params.width) // side)]
        tokens = latents.shape[1]
        if IMAGE_LATENTS in cond:
            shapes += [(1, height // side, width // side) for width, height in self.reference_sizes(request)]
            latents = torch.cat([latents, cond[IMAGE_LATENTS]], dim=1)
        timestep = timesteps.to(latents.dtype) / 1000
        residuals = None
        if self.controlnets is not None:  # text-to-image only: no reference tokens
            residuals = self.controlnets.residuals(states, latents, timestep, cond)
        text, mask = _padded_text(cond[_TEXT], cond[_MASK], self.sequence_degree())
        out: Tensor = self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=cond.get("guidance"),
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=text,
            img_shapes=[shapes] * latents.shape[0],
            return_dict=False,
            **(residuals or {}),
        )[0]
        return out[:, :tokens]

    def takes_controlnet(self) -> bool:
        # QwenImageControlNetPipeline: text-to-image only (diffusers has no Qwen-Image ControlNet
        # img2img; its ControlNet inpainting pipeline is another kind of model, not served).
        return self.use.task is TEXT_TO_IMAGE and self.steps()

    def load_controlnets(self, sources: tuple[tuple[str, str], ...]) -> QwenImageControlNets:
        # On one device, as FLUX's (the settings refuse `--controlnet` in a lane).
        return QwenImageControlNets.load(self.pipe, sources)

    def latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        """(B, C, h, w): the packed tokens unpacked, without the VAE's frame axis."""
        params = states[0].request.params
        unpacked: Tensor = self.pipe._unpack_latents(
            latents, resolved(params.height), resolved(params.width), self.pipe.vae_scale_factor
        )
        return unpacked[:, :, 0]

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = self.latent_grid(states, latents)[:, :, None].to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="np")

    # Input images: the pipelines' own `_encode_vae_image` (normalised latents), one frame --

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        pixels = pixels.to(self.device, dtype).unsqueeze(2)
        encoded: Tensor = self.pipe._encode_vae_image(pixels, generators).transpose(1, 2)
        return encoded

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = packed_size(self.pipe, request)
        return (request.params.n, 1, self.pipe.transformer.config.in_channels // 4, height, width)

    def pack(self, latents: Tensor, request: GenerationRequest) -> Tensor:
        height, width = packed_size(self.pipe, request)
        channels = self.pipe.transformer.config.in_channels // 4
        packed: Tensor = self.pipe._pack_latents(latents, request.params.n, channels, height, width)
        return packed

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        # The pipeline also encodes the masked image, which its transformer never reads.
        return packed_mask(self.pipe, request, condition, self.device, dtype), None


def _padded_text(text: Tensor, mask: Tensor, degree: int) -> tuple[Tensor, Tensor]:
    """The prompt rows padded under their mask to a multiple of `degree` tokens, as `merge`
    pads shorter prompts to the longest: the plan cuts the text and its rotary embedding
    into `degree` equal parts. Masked tokens are no key of any attention, and the text's
    rotary positions start where they did, so the prediction is the unpadded one."""
    missing = -text.shape[1] % degree
    if missing == 0:
        return text, mask
    text = torch.cat([text, text.new_zeros((text.shape[0], missing, *text.shape[2:]))], dim=1)
    return text, torch.cat([mask, mask.new_zeros((mask.shape[0], missing))], dim=1)
