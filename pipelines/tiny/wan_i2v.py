"""Builder of `tiny-wan-i2v`: a WanImageToVideoPipeline (Wan 2.1 image-to-video) with small random weights.

Text encoder, VAE, scheduler and transformer shape are tiny-wan's, so the same rules hold:
frames are 4k+1 (others are rounded, with a warning) and sides multiples of 16 (enforced); the
default size, 480x832 with 81 frames, is a constant of `__call__`. The input image is resized
(stretched, not cropped) to the requested size and VAE-encoded as the first frame of a condition
video; the transformer reads it as 20 extra channels (a 4-channel first-frame mask and 16 latent
channels: in_channels 36). A CLIP vision encoder also turns it into 65 tokens the transformer
attends to beside the prompt. One call takes ONE image (a PIL image or a tensor) for all prompts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    CLIPVisionModel,
    UMT5Config,
    UMT5EncoderModel,
)

from pipelines.tiny.tokenizers import t5_tokenizer

# Width of the text encoder's hidden states, the transformer's text input.
_TEXT_DIM = 32
# Wan's VAE latent channels.
_LATENT_CHANNELS = 16
# The condition the transformer reads beside the noisy latents: a first-frame mask, one channel
# per frame of the VAE's 4x temporal compression, then the VAE latents of the condition video.
_CONDITION_CHANNELS = 4 + _LATENT_CHANNELS
# Width of the image encoder's hidden states, the transformer's image input (`image_dim`).
_IMAGE_DIM = 4
# Side of the image encoder's square input and of its patches: 8x8 patches plus the class token.
_IMAGE_SIZE = 32
_IMAGE_PATCH = 4
# As in tiny-wan: scales the transformer's cross-attention keys so that different prompts,
# zero-padded to 512 tokens with no mask, visibly change the video (see pipelines.tiny.wan).
_TEXT_KEY_GAIN = 5.0


def build_tiny_wan_i2v(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # The pipeline pads every prompt to 512 tokens.

    torch.manual_seed(0)
    # Wan's text encoder is UMT5 (google/umt5-xxl): T5 with per-layer relative attention biases.
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=_TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    # Wan 2.1 I2V's image encoder is CLIP ViT-H/14; the pipeline reads its penultimate hidden states.
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=_IMAGE_DIM,
            intermediate_size=16,
            projection_dim=_IMAGE_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=_IMAGE_SIZE,
            patch_size=_IMAGE_PATCH,
        )
    ).eval()
    # The PIL backend, named explicitly: CLIPImageProcessor is the torchvision backend, which
    # transformers replaces by this class only where torchvision is missing, so naming it keeps
    # the saved files the same on every host and loads without torchvision. It resizes the
    # shortest edge to 32, then centre-crops 32x32, as Wan's CLIP does at 224.
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": _IMAGE_SIZE},
        crop_size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE},
    )

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # Rotary sections: 4 for frames, 4 for height, 4 for width.
        in_channels=_LATENT_CHANNELS + _CONDITION_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        text_dim=_TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=_IMAGE_DIM,  # Adds the image tokens to cross-attention, as in Wan 2.1 I2V.
    )
    with torch.no_grad():
        for block in transformer.blocks:
            block.attn2.norm_k.weight.mul_(_TEXT_KEY_GAIN)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],  # Three downsampling stages: 8x, as scale_factor_spatial says.
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # Two in time: 4x, as scale_factor_temporal says.
    )
    # Wan 2.1's schedule (480p): UniPC over flow-matching sigmas shifted by 3.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
