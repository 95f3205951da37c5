"""Builders of `tiny-hunyuan-video15` and `tiny-hunyuan-video15-i2v`: HunyuanVideo 1.5 text- and
image-to-video with small random weights.

HunyuanVideo 1.5 reads a prompt twice: Qwen2.5-VL-7B (its text model only, the hidden states two
layers from the top) over a chat template whose system message and scaffolding the pipeline cuts
off (`prompt_template_encode_start_idx`, 108 tokens), and ByT5 over the prompt's quoted text
only (glyphs; a prompt without quotes gives an all-zero, all-masked 256-token embedding). The
image-to-video model also reads the input image with SigLIP, and both transformers take an image
embedding: zeros (729 tokens) in text-to-video, which the transformer detects to mask them.

The VAE keeps HunyuanVideo 1.5's compression (16x in space, 4x in time, five encoder blocks) with
8 latent channels instead of 32; the transformer reads latents, condition latents and a mask
(in_channels 2 x 8 + 1) in 1x1x1 patches. So frames are 4k+1 and sides multiples of 16.
`target_size` 32 (640 at 480p) is the side, in pixels, of the square whose area the default
size keeps: text-to-video without a size, and image-to-video always (its size is the input
image's aspect ratio bucketed to that area), are 32x32 for a square. Guidance is not a call
argument: it is the `guider` component's `guidance_scale`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from pipelines.tiny.gains import scale, scale_each
from pipelines.tiny.tokenizers import qwen2_tokenizer

# Qwen2.5-VL's chat template, reduced to what the pipeline sends: a system and a user message
# with text content, and the generation prompt.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Widths of the three condition streams the transformer reads: Qwen2.5-VL's hidden states (3584),
# ByT5's (1472) and SigLIP's (1152).
_TEXT_DIM = 16
_GLYPH_DIM = 8
_IMAGE_DIM = 8
_LATENT_CHANNELS = 8
# The side of the default size's square, in pixels (640 for the 480p checkpoints).
_TARGET_SIZE = 32
# Guidance of the published checkpoints (the official README's 6.0), held by the guider.
_GUIDANCE_SCALE = 6.0
# The flow-matching shift; the official settings are 5 at 480p and 7 to 9 at 720p.
_SHIFT = 5.0
# Gains on the transformer (`pipelines.tiny.gains`), issue 47. With plain random weights guidance
# +0.5 moved the video by 3/255 (image-to-video: 1, its 64 image tokens beside the text) and the
# cache setting by 4. Stronger text values in the double-stream attention, stronger attention
# outputs (those blocks' and the token refiner's) and a stronger output projection bring guidance
# to 18/255 (image-to-video: 10) and the cache to 58 (18), the frames no more saturated. Sharper
# text keys moved guidance less (1-2/255); the output projection alone, to 4 (1).
_TEXT_VALUE_GAIN = 5.0
_MIXING_GAIN = 3.0
_OUTPUT_GAIN = 3.0


def build_tiny_hunyuan_video15(directory: Path) -> None:
    """Build the text-to-video pipeline with fixed seeds and save it to `directory`."""
    tokenizer = _tokenizer()
    pipe = HunyuanVideo15Pipeline(**_shared_components(tokenizer), transformer=_transformer("t2v"))
    _check_template_prefix(pipe, tokenizer)
    pipe.save_pretrained(directory, safe_serialization=True)


def build_tiny_hunyuan_video15_i2v(directory: Path) -> None:
    """Build the image-to-video pipeline with fixed seeds and save it to `directory`."""
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    # SigLIP so400m (patch 14 at 384: 729 tokens); here 8x8 patches of a 32x32 image: 64 tokens.
    image_encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=_IMAGE_DIM,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=4,
        )
    ).eval()
    # The PIL backend, named so the saved files and loading never depend on torchvision.
    feature_extractor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    pipe = HunyuanVideo15ImageToVideoPipeline(
        **_shared_components(tokenizer),
        transformer=_transformer("i2v"),
        image_encoder=image_encoder,
        feature_extractor=feature_extractor,
    )
    _check_template_prefix(pipe, tokenizer)
    pipe.save_pretrained(directory, safe_serialization=True)


def _tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer that keeps every word of the system message whole, as Qwen's own does, so
    the templated prefix is the 108 tokens the pipeline drops (checked once the pipeline exists)."""
    system_message = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters[
        "system_message"
    ]
    tokenizer = qwen2_tokenizer(_prefix(str(system_message.default)))
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _prefix(system_message: str) -> str:
    """What the chat template puts before the user's prompt."""
    return f"<|im_start|>system\n{system_message}<|im_end|>\n<|im_start|>user\n"


def _check_template_prefix(
    pipe: HunyuanVideo15Pipeline | HunyuanVideo15ImageToVideoPipeline, tokenizer: Qwen2Tokenizer
) -> None:
    """The pipeline drops `prompt_template_encode_start_idx` leading tokens of every templated
    prompt: they must be exactly the template's prefix (else prompts lose their first words)."""
    prefix = _prefix(pipe.system_message)
    messages = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "cat"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not str(rendered).startswith(prefix):
        raise RuntimeError(f"the chat template renders {rendered!r}, which does not start with {prefix!r}")
    prefix_tokens = len(tokenizer(prefix).input_ids)
    if prefix_tokens != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the chat template's prefix is {prefix_tokens} tokens, but {type(pipe).__name__} drops "
            f"{pipe.prompt_template_encode_start_idx}"
        )


def _shared_components(tokenizer: Qwen2Tokenizer) -> dict[str, Any]:
    """Everything but the transformer and the image encoder; each part seeds itself."""
    vocab = tokenizer.get_vocab()
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=3,  # The pipeline reads the states two layers from the top.
            num_attention_heads=2,
            num_key_value_heads=2,
            # The sections sum to half the head size (16 / 2 heads / 2).
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
            bos_token_id=vocab["<|endoftext|>"],
            eos_token_id=vocab["<|im_end|>"],
            pad_token_id=vocab["<|endoftext|>"],
        )
    ).eval()

    glyph_tokenizer = ByT5Tokenizer()  # Bytes: no vocabulary to build.
    torch.manual_seed(0)
    # ByT5-small's encoder (1472 wide, 12 layers) over its 256 bytes, 3 specials and 125 extra ids.
    glyph_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(glyph_tokenizer),
            d_model=_GLYPH_DIM,
            d_kv=4,
            d_ff=16,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=glyph_tokenizer.pad_token_id,
            eos_token_id=glyph_tokenizer.eos_token_id,
            decoder_start_token_id=glyph_tokenizer.pad_token_id,
        )
    ).eval()

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=_LATENT_CHANNELS,
        # Five blocks like the real (128, 256, 512, 1024, 1024): the first four halve the sides
        # (16x), the middle two halve time too (4x). The last width is twice the latent channels,
        # as the encoder's channel grouping at its output requires.
        block_out_channels=(8, 8, 8, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()

    return {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=_SHIFT),
        "text_encoder_2": glyph_encoder,
        "tokenizer_2": glyph_tokenizer,
        "guider": ClassifierFreeGuidance(guidance_scale=_GUIDANCE_SCALE),
    }


def _transformer(task_type: str) -> HunyuanVideo15Transformer3DModel:
    """The 8.3B transformer (2048 wide: 16 heads x 128, 54 double-stream layers, a 2-layer token
    refiner), narrowed; `task_type` is "t2v" or "i2v", as in the two published checkpoints."""
    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * _LATENT_CHANNELS + 1,  # Noisy latents, condition latents, condition mask.
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=_TEXT_DIM,
        text_embed_2_dim=_GLYPH_DIM,
        image_embed_dim=_IMAGE_DIM,
        rope_axes_dim=(2, 2, 4),  # Frames, height, width; sums to attention_head_dim.
        target_size=_TARGET_SIZE,
        task_type=task_type,
    )
    scale_each(transformer, "attn.add_v_proj", _TEXT_VALUE_GAIN)
    scale_each(transformer, "attn.to_out.0", _MIXING_GAIN)
    scale(transformer.proj_out, _OUTPUT_GAIN)
    return transformer
