"""Builder of `tiny-ltx2`: an LTX2Pipeline (LTX-2 text-to-video with audio) with small random weights.

The video VAE compresses 8x in time and space (LTX-2's own is 8x and 32x), so frames are 8k+1
(the pipeline does not check: other counts come back as the 8k+1 below them) and 32x32 frames
are 4x4 latents; LTX2Pipeline itself demands sides that are multiples of 32. The audio keeps
LTX-2's chain: 16 kHz mel frames with a 160-sample hop, 4x compressed in time by the audio VAE,
then a vocoder whose upsampling equals that hop, so the stereo waveform (batch, 2, samples) at
16 kHz lasts as long as the video, less the 30 ms (3 mel frames) the causal audio VAE trims
(diffusers' test vocoder upsamples only 4x: its audio is 1/40 as long).
The defaults, 512x768, 121 frames at 24 fps, are constants of `__call__`: callers pass sizes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from pipelines.tiny.gains import scale_each
from pipelines.tiny.gemma import gemma_tokenizer

# Width of the text encoder's hidden states; the connectors project every layer's states to it.
_TEXT_DIM = 32
_TEXT_LAYERS = 2
# The video VAE's latent channels; the transformer sees them unpatched (1x1x1 patches, like LTX-2).
_LATENT_CHANNELS = 8
# Three spatio-temporal blocks of the video VAE: 8x compression of time, height and width.
_SCALING = (True, True, True)
# The audio: stereo mel spectrograms of 8 bins at 16 kHz with a 160-sample hop (100 frames a second).
_SAMPLE_RATE = 16000
_HOP_LENGTH = 160
_MEL_BINS = 8
_AUDIO_CHANNELS = 2
# The audio VAE's latent channels; it always compresses time and mel bins 4x, and its latent
# statistics have `base_channels` entries, which must equal the packed width: channels x mel bins / 4.
_AUDIO_LATENT_CHANNELS = 2
_AUDIO_BASE_CHANNELS = _AUDIO_LATENT_CHANNELS * _MEL_BINS // 4
# Multiplies every vocoder convolution's weight (their biases are zeroed). At the default init
# this narrow stack of convolutions shrinks its input so much that the waveform was mostly the
# biases' constant offset: two seeds moved it by 2e-3 at most, two prompts by 1e-4 to 2e-3.
# Doubled weights give audio of std ~0.07 in which two seeds differ by up to ~0.4 and two
# prompts with one seed by 0.02 (no guidance) to 0.15 (guidance 4).
_VOCODER_GAIN = 2.0
# Gains on the video stream's text cross-attention (`pipelines.tiny.gains`), issue 47: with plain
# random weights guidance +0.5 moved the video by 3/255. Sharper text keys, stronger text values
# and a stronger cross-attention output bring it to 14/255 (a prompt 30 -> 68), the frames no more
# saturated; a stronger output projection moved guidance less, not more (2/255 at x3).
_TEXT_KEY_GAIN = 4.0
_TEXT_VALUE_GAIN = 3.0
_CROSS_GAIN = 3.0


def build_tiny_ltx2(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = gemma_tokenizer(max_length=1024)  # LTX2Pipeline pads prompts to 1024 by default.

    torch.manual_seed(0)
    # LTX-2's text encoder is Gemma 3 (12B) with its SigLIP vision tower; only the text part runs.
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer),
                hidden_size=_TEXT_DIM,
                intermediate_size=64,
                num_hidden_layers=_TEXT_LAYERS,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                query_pre_attn_scalar=16,
                max_position_embeddings=2048,
                sliding_window=512,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id,
            ),
            vision_config=SiglipVisionConfig(
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=8,
                patch_size=4,
            ),
            mm_tokens_per_image=4,  # The 2x2 patches of an 8x8 image, pooled by a 1x1 kernel.
        )
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    # LTX-2.0's connectors: every Gemma layer's states (embeddings included) are normalized,
    # projected to _TEXT_DIM and refined separately for the video and the audio stream.
    connectors = LTX2TextConnectors(
        caption_channels=_TEXT_DIM,
        text_proj_in_factor=_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,  # 4 x 8 = _TEXT_DIM, the connector's width.
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )

    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,  # Must equal num_attention_heads * attention_head_dim.
        vae_scale_factors=(8, 8, 8),  # Maps latent positions to frames and pixels for RoPE.
        audio_in_channels=_AUDIO_BASE_CHANNELS,  # Packed audio tokens: channels x latent mel bins.
        audio_out_channels=_AUDIO_BASE_CHANNELS,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,  # Must equal audio_num_attention_heads * audio_attention_head_dim.
        audio_sampling_rate=_SAMPLE_RATE,
        audio_hop_length=_HOP_LENGTH,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=_TEXT_DIM,
        rope_double_precision=False,
        rope_type="split",
    )
    scale_each(transformer, "attn2.norm_k", _TEXT_KEY_GAIN)
    scale_each(transformer, "attn2.to_v", _TEXT_VALUE_GAIN)
    scale_each(transformer, "attn2.to_out.0", _CROSS_GAIN)

    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 3,
        decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=_SCALING,
        decoder_spatio_temporal_scaling=_SCALING,
        decoder_inject_noise=(False,) * 4,
        downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3,
        upsample_residual=(False,) * 3,
        upsample_factor=(1,) * 3,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        timestep_conditioning=False,  # Like LTX-2: decode_timestep is ignored.
    )

    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=_AUDIO_BASE_CHANNELS,
        output_channels=_AUDIO_CHANNELS,
        ch_mult=(1, 1, 1),  # Two upsamplings: the decoder restores the 4x it always assumes.
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=_AUDIO_CHANNELS,
        resolution=32,
        latent_channels=_AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=_SAMPLE_RATE,
        mel_hop_length=_HOP_LENGTH,
        is_causal=True,
        mel_bins=_MEL_BINS,
    )

    torch.manual_seed(0)
    # Upsampling by 10 x 4 x 4 = _HOP_LENGTH turns each mel frame into its 160 samples at 16 kHz;
    # kernel minus stride is even in every layer, so each upsampling is exact.
    vocoder = LTX2Vocoder(
        in_channels=_AUDIO_CHANNELS * _MEL_BINS,
        hidden_channels=32,
        out_channels=_AUDIO_CHANNELS,
        upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=_SAMPLE_RATE,
    )
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.weight.mul_(_VOCODER_GAIN)
                if module.bias is not None:
                    module.bias.zero_()

    # LTX-2's schedule: the shift grows with the number of video latent tokens.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
