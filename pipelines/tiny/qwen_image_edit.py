"""Builders of `tiny-qwen-image-edit`, `tiny-qwen-image-edit-plus` and
`tiny-qwen-image-edit-2511`: QwenImageEditPipeline and QwenImageEditPlusPipeline with small
random weights.

Qwen-Image-Edit-2511 is an Edit Plus model (same pipeline class and components) whose
transformer sets `zero_cond_t`: the reference images' tokens are modulated with timestep 0
(the batch doubles inside the modulation, and a per-token index picks noise or reference);
diffusers reads the flag from the transformer's config.json. The two pipelines share every
component (Qwen-Image's, plus a Qwen2-VL processor whose vision tower now sees the input
image); only the pipeline class differs. The processor has
no video processor (see `pipelines.qwen_edit_loading`), so the models load with
`load_qwen_image_edit`, not a plain `from_pretrained`, on hosts without torchvision.

Whatever size is asked, the pipelines resize each input image to about 1024x1024 pixels for
the VAE, so the VAE's cost and the input's share of the transformer's tokens do not shrink with
the request. The tiny VAE therefore has 4 channels and downsamples 16x, in four stages
(Qwen-Image's own downsamples 8x, in three): 1,024 tokens per input image where 8x gave 4,096
(the text-to-image tiny model's 2x would give 65,536), and its mid-block attention over 64x64
latent pixels, not 128x128. A call takes about half the time an 8x, 8-channel VAE took. Sizes
are therefore multiples of 32 here (the pipelines' rule is twice the VAE's factor), against 16
for the real models; the server reads the rule from the pipeline either way.

The processor's `longest_edge` (a pixel budget, 112x112 here against 3584x3584 for the real
model) keeps the vision tower small too: at most 64 patches, 16 image tokens, per image.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pipelines.qwen_edit_loading import ImageOnlyQwen2VLProcessor
from pipelines.tiny.qwen_image import (
    LATENT_CHANNELS,
    check_template_prefix,
    qwen_image_scheduler,
    qwen_image_transformer,
    qwen_text_encoder,
)
from pipelines.tiny.tokenizers import qwen2_tokenizer

# diffusers' QwenImageEditPipeline.prompt_template_encode (QwenImageEditPlusPipeline's has
# the same prefix and puts "Picture 1: " and the vision tokens in the user's text instead):
# the tokenizer learns its words whole.
_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the "
    "image. Generate a new image that meets the user's requirements while maintaining consistency "
    "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
_PLUS_IMAGE_PROMPT = "Picture 1: "
# The vision tower's patches (Qwen2-VL's own sizes), merged 2x2 into one image token each.
_PATCH_SIZE = 14
_MERGE_SIZE = 2
# The processor resizes each image to at most this many pixels (and at least 56x56).
_MAX_IMAGE_PIXELS = 112 * 112


def build_tiny_qwen_image_edit(directory: Path) -> None:
    """Build QwenImageEditPipeline with fixed seeds and save it to `directory`."""
    _build(QwenImageEditPipeline, directory)


def build_tiny_qwen_image_edit_plus(directory: Path) -> None:
    """Build QwenImageEditPlusPipeline with fixed seeds and save it to `directory`."""
    _build(QwenImageEditPlusPipeline, directory)


def build_tiny_qwen_image_edit_2511(directory: Path) -> None:
    """Build QwenImageEditPlusPipeline with Edit-2511's transformer (`zero_cond_t`)."""
    _build(QwenImageEditPlusPipeline, directory, zero_cond_t=True)


def _build(pipeline_class: type[DiffusionPipeline], directory: Path, zero_cond_t: bool = False) -> None:
    tokenizer = qwen2_tokenizer(_PROMPT_TEMPLATE.format(_PLUS_IMAGE_PROMPT))
    processor = ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            size={"shortest_edge": 56 * 56, "longest_edge": _MAX_IMAGE_PIXELS},
            patch_size=_PATCH_SIZE,
            merge_size=_MERGE_SIZE,
            temporal_patch_size=2,
        ),
        tokenizer=tokenizer,
    )

    text_encoder = qwen_text_encoder(
        tokenizer,
        patch_size=_PATCH_SIZE,
        spatial_merge_size=_MERGE_SIZE,
        temporal_patch_size=2,
        fullatt_block_indexes=[0],  # Its one block attends to the whole image.
    )
    transformer = qwen_image_transformer(zero_cond_t=zero_cond_t)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, False, False, False],  # Four 2x spatial stages: 16x.
    )
    # With random biases, the stages' biases swamp the signal: the encoded image and the
    # decoded latents barely mattered (a different prompt or input image moved pixels by under
    # 1/255). Without biases those differences are about 0.1.
    with torch.no_grad():
        for name, parameter in vae.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    pipe = pipeline_class(
        scheduler=qwen_image_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    # The prefix ends before the image and the user's text.
    check_template_prefix(
        pipe, tokenizer, pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    )
    # model_index.json names the stock processor class, the one the real models name.
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    pipe.save_pretrained(directory, safe_serialization=True)
