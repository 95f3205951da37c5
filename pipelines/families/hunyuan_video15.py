"""HunyuanVideo 1.5: text- and image-to-video, step-level and request-level, following
`HunyuanVideo15Pipeline.__call__`.

Each prompt is read twice: Qwen2.5-VL over a chat template padded to a fixed length (1000
tokens after the cut prefix) and ByT5 over its quoted text only (256 tokens, all masked
without quotes), both with per-row masks, so rows of different prompts concatenate and the
transformer keeps each row's own valid tokens. A step's forward drops the token columns no
row reads (`_without_padding`), and text-to-video's 729 zero image tokens: every row attends
over all it is given, so the padding, not the prompts, made a step's cost (at the tiny
model's 32x32 a step took ~30x longer). Guidance is not a call argument but the pipeline's
`guider` (classifier-free, on unless the scale is 1): request level puts a new
guider with the batch's scale on the pipeline before each call (the scale is in the batch
key); step level guides each request with its own scale as the guider would. Latents are
drawn in the transformer's dtype, not float32, as the stock call draws them. Text-to-video
reads zero condition latents and a zero mask beside its latents.

Two defects of diffusers 0.42.1 shape the rest: the VAE's mid-block attention fails on a
batch of more than one video (its causal mask is built per batch, read as heads), so the
VAE decodes one video at a time (`enable_slicing` at request level, one decode per video
in `decode`); and `num_videos_per_prompt > 1` fails in the transformer (zero image
embeddings sized by prompts), which n expanded into prompts never asks for.

Image-to-video: its size is the input image's aspect ratio bucketed to the model's area
(not a call argument: `size_from_image`, and a request asking another size is refused), so
requests of one bucket share a step key. Each request's SigLIP embedding and first-frame VAE
latents (with their mask) are made once at prepare (`image_to_video_latents`) and read by
every step in place of text-to-video's zeros; the transformer tells text- from
image-to-video by zero image embeddings over the whole batch, which separate adapters keep
apart. The mean-flow checkpoints (a second timestep per row) stay request-level.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import Sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, own_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.video import IMAGE_TO_VIDEO, TEXT_TO_VIDEO

# Image-to-video conditioning, per row: the first frame's latents and mask, SigLIP's tokens.
_CONDITION = "condition"
_IMAGE_EMBEDS = "image_embeds"
# The encoder outputs of one prompt, by the transformer's argument names.
_TEXT = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "encoder_hidden_states_2",
    "encoder_attention_mask_2",
)


def _default_size(pipe: Any) -> tuple[int, int]:
    """The call's default: 16:9 at the model's target area (848x480 for the 480p weights)."""
    aspect_w, aspect_h = pipe.default_aspect_ratio
    height, width = pipe.video_processor.calculate_default_height_width(aspect_h, aspect_w, pipe.target_size)
    return int(width), int(height)


def _size_multiple(pipe: Any) -> int:
    return int(pipe.vae_scale_factor_spatial) * int(pipe.transformer.config.patch_size)


def _without_padding(cond: Conditioning) -> dict[str, Tensor]:
    """The rows' Qwen and ByT5 tokens without the columns masked in every row.

    Each row attends over its latents and every text token column, its padding masked: a
    forward's cost grows with the padded lengths (1000 + 256), not the prompts' (a short
    prompt is ~10 tokens, no quotes no ByT5 token). A column no row reads changes no row's
    output: the transformer moves each row's valid tokens to the front, text carries no
    position, and a masked key adds nothing to any softmax. So a group's rows attend over
    its longest prompt, within float rounding of the stock call's padded forward.
    """
    text: dict[str, Tensor] = {}
    for states_name, mask_name in (_TEXT[:2], _TEXT[2:]):
        mask = cond[mask_name]
        used = mask.bool().any(dim=0)
        text[states_name], text[mask_name] = cond[states_name][:, used], mask[:, used]
    return text


class HunyuanVideo15(Family):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_VIDEO, "HunyuanVideo15Pipeline"),
        TaskUse(IMAGE_TO_VIDEO, "HunyuanVideo15ImageToVideoPipeline"),
    )
    key_name: ClassVar[str] = "hunyuan-video-1.5"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 6.0
    default_fps: ClassVar[int] = 24
    default_num_frames: ClassVar[int] = 121
    sizes: ClassVar[Sizes] = Sizes(default=_default_size, multiple=_size_multiple)

    def __init__(self, pipe: Any, config: Any, use: TaskUse) -> None:
        super().__init__(pipe, config, use)
        # A batched call decodes several videos in one VAE call, which this VAE cannot.
        pipe.vae.enable_slicing()

    def size_from_image(self, image: np.ndarray) -> tuple[int, int]:
        """(width, height) image-to-video makes from `image`: its aspect ratio's bucket."""
        height, width = self.pipe.video_processor.calculate_default_height_width(
            height=image.shape[0], width=image.shape[1], target_size=self.pipe.target_size
        )
        return int(width), int(height)

    # Request level ------------------------------------------------------------------------

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # The guider holds the scale; the call takes none. Set here, just before the call, on
        # the one thread that calls the pipeline.
        self.pipe.guider = self.pipe.guider.new(guidance_scale=resolved(params.guidance_scale))
        return {}

    # Step level -----------------------------------------------------------------------------

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return (self.pipe.transformer,)  # step mode: one forward per step with every row

    def first_block_steps(self) -> bool:
        return True

    def steps(self) -> bool:
        if self.pipe.transformer.config.get("use_meanflow", False):
            return False  # a second, per-step timestep (`timestep_r`) the stages do not give
        # The stages guide as the guider's plain formula over every step: not with a
        # rescale, the original formulation or CFG limited to part of the steps.
        guider = self.pipe.guider.config
        if guider.get("guidance_rescale", 0.0) != 0.0 or guider.get("use_original_formulation", False):
            return False
        return bool(guider.get("start", 0.0) == 0.0 and guider.get("stop", 1.0) == 1.0)

    def uses_cfg(self, request: GenerationRequest) -> bool:
        # The guider runs the negative branch unless the scale is 1 (0.5 guides too).
        return bool(self.pipe.guider.config.get("enabled", True)) and not math.isclose(
            resolved(request.params.guidance_scale), 1.0
        )

    def context_tokens(self, request: GenerationRequest) -> int:
        # Every row attends over its group's longest prompt (`_without_padding`): up to the
        # encoders' 1000 Qwen and 256 ByT5 tokens, counted whole so that a request's cost
        # never hangs on its prompt or its group, and the default shape's budget holds
        # `max_num_seqs` requests whatever they say. Image-to-video adds the image's SigLIP
        # tokens (text-to-video passes none). At the tiny model's 32x32 most of the cost.
        pipe = self.pipe
        return int(pipe.tokenizer_max_length + pipe.tokenizer_2_max_length) + self._image_tokens()

    def _image_tokens(self) -> int:
        """SigLIP's tokens in image-to-video (729 at 384 px in patches of 14); none else."""
        encoder = getattr(self.pipe, "image_encoder", None)
        if encoder is None:
            return 0
        return int(encoder.config.image_size // encoder.config.patch_size) ** 2

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        dtype = self.pipe.transformer.dtype

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            # The glyph encoder runs once per prompt inside; the Qwen one over all of them.
            encoded: tuple[Tensor, ...] = self.pipe.encode_prompt(
                prompt=texts, device=self.device, dtype=dtype, batch_size=len(texts)
            )
            return encoded

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return dict(zip(_TEXT, rows, strict=True))

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def scheduler(self, request: GenerationRequest) -> Any:
        steps = resolved(request.params.num_inference_steps)
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        scheduler = own_scheduler(self.pipe.scheduler, None, self.device, sigmas=sigmas)
        scheduler.set_begin_index(0)  # the stock call finds index 0 from the timestep
        return scheduler

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        """The request's noise in the transformer's dtype, as the stock call draws it."""
        pipe, params = self.pipe, request.params
        latents: Tensor = pipe.prepare_latents(
            params.n,
            pipe.num_channels_latents,
            resolved(params.height),
            resolved(params.width),
            resolved(params.num_frames),
            pipe.transformer.dtype,
            self.device,
            generators,
        )
        return latents

    def image_to_video_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """The noise, and in both conditionings the image's SigLIP tokens and its first-frame
        latents with their mask (the VAE's mode: the generators draw only the noise), as
        the stock call makes them from the image cropped to the request's (bucketed) size."""
        pipe, params = self.pipe, request.params
        device, n, dtype = self.device, params.n, pipe.transformer.dtype
        width, height = resolved(params.width), resolved(params.height)
        image = Image.fromarray(request.input_images[0])
        image = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        embeds = pipe.encode_image(image=image, batch_size=n, device=device, dtype=dtype)
        latents: Tensor = pipe.prepare_latents(
            n,
            pipe.num_channels_latents,
            height,
            width,
            resolved(params.num_frames),
            dtype,
            device,
            generators,
        )
        with self.vae_lock:  # the VAE encodes the first frame; a decode may be running beside
            condition, mask = pipe.prepare_cond_latents_and_mask(
                latents, image, n, height, width, dtype, device
            )
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update({_CONDITION: torch.cat([condition, mask], dim=1), _IMAGE_EMBEDS: embeds})
        return latents

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        pipe = self.pipe
        transformer = pipe.transformer
        dtype = transformer.dtype
        text = _without_padding(cond)
        if _CONDITION in cond:
            condition, image_embeds = cond[_CONDITION], cond[_IMAGE_EMBEDS]
        else:
            # Text-to-video: zero condition latents and mask; no image tokens. The stock call
            # passes 729 zero ones, which the transformer reads as "no image" (it tests the
            # whole batch) and masks in every row: padding too, so none are passed.
            rows, channels, frames, height, width = latents.shape
            condition = latents.new_zeros((rows, channels + 1, frames, height, width), dtype=dtype)
            image_embeds = torch.zeros((rows, 0, pipe.vision_states_dim), dtype=dtype, device=latents.device)
        out: Tensor = transformer(
            hidden_states=torch.cat([latents.to(dtype), condition], dim=1),
            image_embeds=image_embeds,
            timestep=timesteps.to(dtype),
            return_dict=False,
            **text,
        )[0]
        return out

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        vae = pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor
        # One video per decode: the VAE's mid-block attention fails on a batch.
        video = torch.cat([vae.decode(row[None], return_dict=False)[0] for row in latents])
        return pipe.video_processor.postprocess_video(video, output_type="np")
