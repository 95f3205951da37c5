"""Full-size architectures with random weights, to measure a GPU with no download.

The denoiser and the VAE have the published shapes (SDXL base's 2.6B-parameter UNet and
its VAE; FLUX.1-dev's 11.9B-parameter transformer and its VAE), so a step and a decode
cost what they cost with real weights. The text encoders keep their output widths but
only two layers (they run once per request, not once per step) and the tokenizers are the
tiny offline ones. Images are noise. Built in memory on the target device, never saved:

    diffbatch serve random-sdxl --pipeline-class bench.fullsize:RandomSDXL --device cuda
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, Self, TypeVar

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
)

from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.denoiser.loading import check_denoiser, prepare_denoiser
from pipelines.families.flux import Flux
from pipelines.families.sdxl import StableDiffusionXL
from pipelines.loading import torch_dtype
from pipelines.memory.loading import fit
from pipelines.memory.quantization import quantize_built
from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer

_M = TypeVar("_M")


class Place(Protocol):
    """Runs a model's constructor on the serving device and in the serving dtype."""

    def __call__(self, factory: Callable[[], _M]) -> _M: ...


# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json.
SDXL_UNET: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
# black-forest-labs/FLUX.1-dev, transformer/config.json.
FLUX_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
# The VAE both use (FLUX's with 16 latent channels and no quant convs).
_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "sample_size": 1024,
}


def sdxl_vae() -> AutoencoderKL:
    return AutoencoderKL(**_VAE, latent_channels=4, scaling_factor=0.13025)


def flux_vae() -> AutoencoderKL:
    return AutoencoderKL(
        **_VAE,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _clip(vocab: dict[str, int], width: int, projection: bool = False) -> Any:
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=width,
        intermediate_size=4 * width,
        num_attention_heads=width // 64,
        num_hidden_layers=2,  # SDXL reads the penultimate layer
        max_position_embeddings=77,
        projection_dim=width,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def build_sdxl(on: Place) -> StableDiffusionXLPipeline:
    vocab, merges = clip_vocab()
    return StableDiffusionXLPipeline(
        vae=on(sdxl_vae),
        text_encoder=on(lambda: _clip(vocab, 768)),
        text_encoder_2=on(lambda: _clip(vocab, 1280, projection=True)),
        tokenizer=CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77),
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77),
        unet=on(lambda: UNet2DConditionModel(**SDXL_UNET)),
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        ),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def build_flux(on: Place) -> FluxPipeline:
    vocab, merges = clip_vocab()
    t5 = t5_tokenizer(max_length=512)
    t5_config = T5Config(**t5_config_fields(t5, d_model=4096, d_kv=64, d_ff=10240))
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=on(flux_vae),
        text_encoder=on(lambda: _clip(vocab, 768)),
        tokenizer=CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77),
        text_encoder_2=on(lambda: T5EncoderModel(t5_config).eval()),
        tokenizer_2=t5,
        transformer=on(lambda: FluxTransformer2DModel(**FLUX_TRANSFORMER)),
    )


def build_on(config: PipelineConfig, build: Callable[[Place], Any]) -> Any:
    """Build with random weights, each model directly on the device in the serving dtype (a
    12B model initialised on a CPU in float32 takes minutes and 48 GB). Schedulers and
    tokenizers are built outside: a scheduler's sigmas must stay float32 on the CPU."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = torch_dtype(config)

    def on(factory: Callable[[], _M]) -> _M:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(config.device):
                return factory()
        finally:
            torch.set_default_dtype(previous)

    torch.manual_seed(0)
    pipe = build(on)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class RandomSDXL(DiffusersAdapter, family=StableDiffusionXL, serves="StableDiffusionXLPipeline"):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        check_denoiser(config)
        pipe = build_on(config, build_sdxl)
        quantize_built(pipe, config.memory)  # --quantization torchao:... (no from_pretrained here)
        fit(pipe, config)  # --offload, layerwise --quantization, --decode-budget
        prepare_denoiser(pipe, config)  # --attention-backend, --compile
        return cls(pipe, config)


class RandomFlux(DiffusersAdapter, family=Flux, serves="FluxPipeline"):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        check_denoiser(config)
        pipe = build_on(config, build_flux)
        quantize_built(pipe, config.memory)  # --quantization torchao:... (no from_pretrained here)
        fit(pipe, config)
        prepare_denoiser(pipe, config)
        return cls(pipe, config)
