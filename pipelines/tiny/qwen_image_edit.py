"""Builders of `tiny-qwen-image-edit` and `tiny-qwen-image-edit-plus`: QwenImageEditPipeline
and QwenImageEditPlusPipeline with small random weights.

The two pipelines share every component (Qwen-Image's, plus a Qwen2-VL processor whose
vision tower now sees the input image); only the pipeline class differs. The processor has
no video processor (see `pipelines.qwen_edit_loading`), so the models load with
`load_qwen_image_edit`, not a plain `from_pretrained`, on hosts without torchvision.

Whatever size is asked, the pipelines resize the input image to about 1024x1024 pixels for
the VAE, so a tiny call costs seconds, not milliseconds. The VAE therefore downsamples 8x like
Qwen-Image's (the text-to-image tiny model's 2x would give the transformer 65,536 image
tokens; 8x gives 4,096), which also keeps the real model's rule that sizes are multiples of
16. The processor's `longest_edge` (a pixel budget, 112x112 here against 3584x3584 for the
real model) keeps the vision tower small too: at most 64 patches, 16 image tokens, per image.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pipelines.qwen_edit_loading import ImageOnlyQwen2VLProcessor
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
# Width of the text encoder's hidden states, the transformer's joint attention input.
_TEXT_DIM = 16
# The VAE's latent channels (Qwen-Image's own); the transformer sees them in 2x2 patches.
_LATENT_CHANNELS = 16
# Sharper text attention, so that a different prompt visibly changes the image (as in
# `pipelines.tiny.qwen_image`).
_TEXT_KEY_GAIN = 5.0
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


def _build(pipeline_class: type[DiffusionPipeline], directory: Path) -> None:
    tokenizer = qwen2_tokenizer(_PROMPT_TEMPLATE.format(_PLUS_IMAGE_PROMPT))
    vocab = tokenizer.get_vocab()
    processor = ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            size={"shortest_edge": 56 * 56, "longest_edge": _MAX_IMAGE_PIXELS},
            patch_size=_PATCH_SIZE,
            merge_size=_MERGE_SIZE,
            temporal_patch_size=2,
        ),
        tokenizer=tokenizer,
    )

    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": _TEXT_DIM,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                # The sections sum to half the head size (16 / 2 heads / 2).
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                "bos_token_id": vocab["<|endoftext|>"],
                "eos_token_id": vocab["<|im_end|>"],
                "pad_token_id": vocab["<|endoftext|>"],
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": _TEXT_DIM,
                "patch_size": _PATCH_SIZE,
                "spatial_merge_size": _MERGE_SIZE,
                "temporal_patch_size": 2,
                "fullatt_block_indexes": [0],  # Its one block attends to the whole image.
            },
            image_token_id=vocab["<|image_pad|>"],
            video_token_id=vocab["<|video_pad|>"],
            vision_start_token_id=vocab["<|vision_start|>"],
            vision_end_token_id=vocab["<|vision_end|>"],
        )
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=_LATENT_CHANNELS * 4,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        guidance_embeds=False,  # Like Qwen-Image-Edit: guidance only through true CFG.
        axes_dims_rope=(8, 4, 4),  # Sums to attention_head_dim.
    )
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_added_k.weight.mul_(_TEXT_KEY_GAIN)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, False, False],  # Three 2x spatial stages, as Qwen-Image's.
    )
    # With random biases, three stages of them swamp the signal: the encoded image and the
    # decoded latents barely mattered (a different prompt or input image moved pixels by under
    # 1/255). Without biases those differences are about 0.1.
    with torch.no_grad():
        for name, parameter in vae.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    # Qwen-Image's schedule: the shift grows with the number of image tokens.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    pipe = pipeline_class(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    # The pipeline drops this many leading tokens of every templated prompt: exactly the
    # system prompt and the user turn's opening, before the image and the user's text.
    prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    prefix_tokens = len(tokenizer(prefix).input_ids)
    if prefix_tokens != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the edit prompt template's prefix is {prefix_tokens} tokens, but {pipeline_class.__name__} "
            f"drops {pipe.prompt_template_encode_start_idx}"
        )
    # model_index.json names the stock processor class, the one the real models name.
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    pipe.save_pretrained(directory, safe_serialization=True)
