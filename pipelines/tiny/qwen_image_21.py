"""Builder of `tiny-qwen-image-21`: a QwenImage21Pipeline (Qwen-Image 2.1) with small random weights.

Qwen-Image 2.1 changes every component of Qwen-Image: a Qwen3-VL encoder read through a
`Qwen3VLProcessor` (last decoder layer before its final norm, left padding, the system prefix
dropped), a 64-channel VAE (AutoencoderKLQwenImage21, RGBA in and out, 16x per side, which the
pipeline hard-codes: its `vae_scale_factor` is the constant 16) whose latents the transformer
reads unpatched, and a transformer (QwenImage21Transformer2DModel) that puts reference images'
tokens *before* the noise and, with `causal_condition`, lets step 0 cache their keys and values.

The processor: transformers' Qwen3VLProcessor owns a video processor, and building or loading
one imports torchvision, which does not import beside this project's CPU torch. The pipeline never
passes videos, so the tiny model is built with an image-only processor (`ImageOnlyQwen3VLProcessor`,
the same files as the stock class) and loads with `pipelines.qwen_edit_loading.load_qwen_image_21`,
as the real model does.

64x64 images are 4x4 latents: 16 image tokens. Reference images are resized to `output_resolution`
squared pixels (default 1024x1024, 4,096 tokens each): tiny calls pass `output_resolution=64`. Its
images come out RGBA (four channels).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pipelines.qwen_edit_loading import ImageOnlyQwen3VLProcessor
from pipelines.tiny.gains import scale, scale_latent_means
from pipelines.tiny.tokenizers import qwen2_tokenizer

# QwenImage21Pipeline's templates: the tokenizer learns their words whole.
_TEMPLATE_WORDS = (
    "system Comprehend and analyze the provided prompt. user assistant <image1> <image2> <image3>"
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TEXT_DIM = 16
# Gains (`pipelines.tiny.gains`). With plain random weights another prompt moved pixels by under
# 1/255 and a different reference image by ~0.0006-0.001 (its 16x-downsampled latents barely
# differ, and the target tokens attend to them weakly); so a reference sent to the wrong request
# went unseen (issue 47). Sharper attention keys, a stronger attention output and reference
# latents scaled to the noise's size make each reference move the image by about 20/255; with
# the attention output x4 (was x3) and the output projection x2, true CFG +0.5 moves it by 12/255
# (was 5) and each reference by 36/255 or more.
_KEY_GAIN = 15.0
_MIXING_GAIN = 4.0
_VAE_ENCODER_GAIN = 10.0
_OUTPUT_GAIN = 2.0
# AutoencoderKLQwenImage21's latent channels, the transformer's input as they are.
_LATENT_CHANNELS = 64


def build_tiny_qwen_image_21(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = qwen2_tokenizer(_TEMPLATE_WORDS)
    tokenizer.chat_template = _CHAT_TEMPLATE
    vocab = tokenizer.get_vocab()
    processor = ImageOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            # Pixel budgets: every reference must keep its size, so its vision slots match the VAE grid.
            size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024},
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
        ),
        tokenizer=tokenizer,
        chat_template=_CHAT_TEMPLATE,
    )
    torch.manual_seed(0)
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": _TEXT_DIM,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [1, 1, 2]},
                "pad_token_id": vocab["<|endoftext|>"],
            },
            vision_config={
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": _TEXT_DIM,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            image_token_id=vocab["<|image_pad|>"],
            video_token_id=vocab["<|video_pad|>"],
            vision_start_token_id=vocab["<|vision_start|>"],
            vision_end_token_id=vocab["<|vision_end|>"],
        )
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1, 1],  # Four 2x stages: the 16x the pipeline assumes.
        num_res_blocks=1,
        temperal_downsample=[False, False, False, False],
    )
    scale_latent_means(vae.quant_conv, _LATENT_CHANNELS, _VAE_ENCODER_GAIN)
    torch.manual_seed(0)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,  # Qwen-Image 2.1: 32 layers of 32 heads of 128.
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
        causal_condition=True,  # Step 0 caches text and reference keys/values (use_kv_cache).
    )
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if name.endswith("attn.norm_k.weight"):
                parameter.mul_(_KEY_GAIN)
            if name.endswith("attn.to_out.0.weight"):
                parameter.mul_(_MIXING_GAIN)
    scale(transformer.proj_out, _OUTPUT_GAIN)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
    )
    pipe = QwenImage21Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor, transformer=transformer
    )
    # model_index.json names the stock processor class, the one the real model names.
    pipe.register_to_config(processor=("transformers", "Qwen3VLProcessor"))
    pipe.save_pretrained(directory, safe_serialization=True)
