"""Training is reproducible: the same seed gives the same weights, another seed others;
a trained Stable Diffusion model saves and loads as any model directory does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionPipeline

from pipelines.trained.autoencoder import train_autoencoder
from pipelines.trained.components import build_autoencoder, build_tokenizer
from pipelines.trained.evaluate import generate
from pipelines.trained.flux import FluxTrainer
from pipelines.trained.loop import LoopConfig, _rate, init_from, train_denoiser
from pipelines.trained.sd import SDTrainer

pytestmark = pytest.mark.slow


def _weights(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, m in modules.items() for key, value in m.state_dict().items()}


def _train(family: type[SDTrainer | FluxTrainer], seed: int) -> SDTrainer | FluxTrainer:
    trainer = family(build_autoencoder(0).eval().requires_grad_(False), seed)
    train_denoiser(trainer, LoopConfig(steps=2, seed=seed, batch_size=2), out=None, log=lambda _: None)
    return trainer


@pytest.mark.parametrize("family", [SDTrainer, FluxTrainer])
def test_the_same_seed_trains_the_same_denoiser_and_another_seed_another(
    family: type[SDTrainer | FluxTrainer],
) -> None:
    first, again, other = (_weights(_train(family, seed).modules()) for seed in (3, 3, 4))
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)
    untrained = _weights(family(build_autoencoder(0), 3).modules())
    assert not all(torch.equal(first[key], untrained[key]) for key in first)


def test_the_same_seed_trains_the_same_autoencoder() -> None:
    first, again = (
        train_autoencoder(
            build_autoencoder(0), steps=2, seed=5, batch_size=2, log=lambda _: None
        ).state_dict()
        for _ in range(2)
    )
    assert all(torch.equal(first[key], again[key]) for key in first)


def test_the_tokenizer_keeps_every_caption_word_whole_and_reads_any_text() -> None:
    tokenizer = build_tokenizer()
    caption = "two large purple triangles in the top left on an orange background"
    assert len(tokenizer.tokenize(caption)) == len(caption.split())
    ids = tokenizer("a zebra ☃ " * 40, truncation=True, max_length=77).input_ids
    assert len(ids) == 77


@pytest.mark.parametrize(
    ("family", "kind"), [(SDTrainer, StableDiffusionPipeline), (FluxTrainer, FluxPipeline)]
)
def test_a_trained_model_saves_and_reloads_as_a_diffusers_pipeline_that_makes_a_picture(
    family: type[SDTrainer | FluxTrainer], kind: type, tmp_path: Path
) -> None:
    _train(family, 0).pipeline().save_pretrained(tmp_path, safe_serialization=True)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert isinstance(pipe, kind)
    pictures = generate(pipe, ["a small red circle on a white background"], [0], steps=2, guidance=3.0)
    assert pictures[0].shape == (64, 64, 3) and pictures[0].dtype == np.uint8


def test_decoder_training_keeps_the_latent_space() -> None:
    before = build_autoencoder(0).state_dict()
    vae = train_autoencoder(
        build_autoencoder(0), steps=1, seed=5, batch_size=2, decoder_only=True, log=lambda _: None
    )
    after = vae.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(("encoder.", "quant_conv.")))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))


@pytest.mark.parametrize("family", [SDTrainer, FluxTrainer])
def test_init_continues_from_a_saved_pipeline(family: type[SDTrainer | FluxTrainer], tmp_path: Path) -> None:
    trained = _train(family, 3)
    trained.pipeline().save_pretrained(tmp_path, safe_serialization=True)
    fresh = family(build_autoencoder(0).eval().requires_grad_(False), 4)
    saved, before = _weights(trained.modules()), _weights(fresh.modules())
    assert not all(torch.equal(saved[key], before[key]) for key in saved)
    init_from(fresh, tmp_path)
    loaded = _weights(fresh.modules())
    assert all(torch.equal(saved[key], loaded[key]) for key in saved)


def test_the_learning_rate_warms_up_then_stays_or_decays_to_its_floor() -> None:
    constant = LoopConfig(steps=1000, warmup=100)
    decaying = LoopConfig(steps=1000, warmup=100, learning_rate=1e-3, min_learning_rate=1e-5)
    assert _rate(constant, 0) == _rate(decaying, 0) == pytest.approx(0.01)
    assert _rate(constant, 999) == 1.0
    assert _rate(decaying, 100) == pytest.approx(1.0)
    assert _rate(decaying, 550) == pytest.approx((1 + 0.01) / 2)
    assert _rate(decaying, 1000) == pytest.approx(0.01)
