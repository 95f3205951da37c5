"""Builder of `tiny-qwen-image`: a QwenImagePipeline with small random weights.

QwenImagePipeline's default size is 128 latent pixels times the VAE's scale factor (a
constant in diffusers, not a config field). This VAE halves each side, so 64x64 images come
from 32x32 latents and the default is 256x256; a VAE that does not downsample would default
to 128x128, the family's smallest, at about twice the cost of each 64x64 image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from pipelines.tiny.gains import scale, scale_each
from pipelines.tiny.tokenizers import qwen2_tokenizer

# diffusers' QwenImagePipeline.prompt_template_encode: the tokenizer learns its words whole.
_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
# Width of the text encoder's hidden states, the transformer's joint attention input.
TEXT_DIM = 16
# The VAE's latent channels (Qwen-Image's own); the transformer sees them in 2x2 patches.
LATENT_CHANNELS = 16
# Scales the transformer's text keys. Random weights spread image-to-text attention so thinly
# that a different prompt moved pixels by under 1/255, too little for a test to see a prompt
# go to the wrong image; sharper text attention makes it about 0.02.
_TEXT_KEY_GAIN = 5.0
# Gains of tiny-qwen-image alone (the Edit models keep theirs), issue 47: true CFG +0.5 moved
# pixels by 2-3/255. The pipeline rescales the guided prediction to the conditional one's norm,
# so only the direction that the text gives it moves the image: stronger text values, attention
# output and output projection bring true CFG to 10/255 or more (the inpainting task's box, a
# quarter of the picture, moves least); stronger text values alone tip the guided prediction
# towards the text's own direction and move it less again.
_TEXT_VALUE_GAIN = 4.0
_MIXING_GAIN = 2.0
_OUTPUT_GAIN = 3.0


def build_tiny_qwen_image(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = qwen2_tokenizer(_PROMPT_TEMPLATE.format(""))
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],  # One 2x spatial downsampling stage.
    )
    pipe = QwenImagePipeline(
        scheduler=qwen_image_scheduler(),
        vae=vae,
        text_encoder=qwen_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_text_guided(qwen_image_transformer()),
    )
    check_template_prefix(pipe, tokenizer, pipe.prompt_template_encode.split("{}")[0])
    pipe.save_pretrained(directory, safe_serialization=True)


# The components below are shared with the tiny Qwen-Image-Edit models; each seeds itself,
# so building one never changes the weights of another.


def qwen_text_encoder(tokenizer: Qwen2Tokenizer, **vision: Any) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL with a tiny text model and vision tower; `vision` adds vision-config fields."""
    vocab = tokenizer.get_vocab()
    torch.manual_seed(0)
    encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": TEXT_DIM,
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
                "out_hidden_size": TEXT_DIM,
                **vision,
            },
            image_token_id=vocab["<|image_pad|>"],
            video_token_id=vocab["<|video_pad|>"],
            vision_start_token_id=vocab["<|vision_start|>"],
            vision_end_token_id=vocab["<|vision_end|>"],
        )
    )
    return encoder.eval()  # Dropout would otherwise stay on in a directly constructed model.


def qwen_image_transformer(zero_cond_t: bool = False) -> QwenImageTransformer2DModel:
    """Qwen-Image's transformer; `zero_cond_t` (Qwen-Image-Edit-2511) modulates the reference
    images' tokens with timestep 0."""
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=LATENT_CHANNELS * 4,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        guidance_embeds=False,  # Like Qwen-Image: guidance only through true CFG.
        axes_dims_rope=(8, 4, 4),  # Sums to attention_head_dim.
        zero_cond_t=zero_cond_t,
    )
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_added_k.weight.mul_(_TEXT_KEY_GAIN)
    return transformer


def _text_guided(transformer: QwenImageTransformer2DModel) -> QwenImageTransformer2DModel:
    """tiny-qwen-image's transformer gains (`pipelines.tiny.gains`): see `_TEXT_VALUE_GAIN`."""
    scale_each(transformer, "attn.add_v_proj", _TEXT_VALUE_GAIN)
    scale_each(transformer, "attn.to_out.0", _MIXING_GAIN)
    scale(transformer.proj_out, _OUTPUT_GAIN)
    return transformer


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Qwen-Image's schedule: the shift grows with the number of image tokens.
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def check_template_prefix(pipe: DiffusionPipeline, tokenizer: Qwen2Tokenizer, prefix: str) -> None:
    """The pipeline drops `prompt_template_encode_start_idx` leading tokens of every templated
    prompt: they must be exactly the template's prefix, or prompts lose their first tokens
    (or keep template tokens)."""
    prefix_tokens = len(tokenizer(prefix).input_ids)
    if prefix_tokens != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the prompt template's prefix is {prefix_tokens} tokens, but {type(pipe).__name__} drops "
            f"{pipe.prompt_template_encode_start_idx}"
        )
