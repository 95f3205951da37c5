"""Training is reproducible: the same seed gives the same weights, another seed others;
a trained Stable Diffusion model saves and loads as any model directory does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionPipeline
from transformers import CLIPTokenizer, T5Config, T5EncoderModel

from pipelines.tiny.bpe import CORPUS, clip_vocab
from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.trained.autoencoder import train_autoencoder
from pipelines.trained.captions import vocabulary_text
from pipelines.trained.components import (
    MAX_TOKENS,
    TEXT_DIM,
    build_autoencoder,
    build_text_encoder,
    build_tokenizer,
)
from pipelines.trained.evaluate import generate
from pipelines.trained.flux import T5_TOKENS, FluxTrainer
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
    assert len(tokenizer.tokenize(vocabulary_text())) == len(vocabulary_text().split())
    t5 = FluxTrainer(build_autoencoder(0), 0).tokenizer_2
    capitals = vocabulary_text(capitals=True)
    assert len(t5.tokenize(capitals)) == len(capitals.split())  # T5 does not lower-case
    ids = tokenizer("a zebra ☃ " * 40, truncation=True, max_length=77).input_ids
    assert len(ids) == 77


@pytest.mark.parametrize(
    ("family", "kind"), [(SDTrainer, StableDiffusionPipeline), (FluxTrainer, FluxPipeline)]
)
def test_a_trained_model_reloads_as_a_diffusers_pipeline_that_draws_what_it_drew_before_saving(
    family: type[SDTrainer | FluxTrainer], kind: type, tmp_path: Path
) -> None:
    trained = _train(family, 0).pipeline()
    trained.save_pretrained(tmp_path, safe_serialization=True)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert isinstance(pipe, kind)
    args: Any = (["a small red circle on a white background"], [0])
    (picture,) = generate(pipe, *args, steps=2, guidance=3.0)
    (before,) = generate(trained, *args, steps=2, guidance=3.0)
    assert picture.shape == (64, 64, 3) and picture.dtype == np.uint8
    # Every weight came back: the same picture, pixel for pixel, and a picture, not a flat field.
    assert np.array_equal(picture, before)
    assert int(picture.max()) - int(picture.min()) > 8


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


@pytest.mark.parametrize("family", [SDTrainer, FluxTrainer])
def test_init_carries_the_embeddings_over_to_a_tokenizer_that_knows_more_words(
    family: type[SDTrainer | FluxTrainer], tmp_path: Path
) -> None:
    """A pipeline saved with a smaller vocabulary (as the weights shipped before issue 41)
    encodes its old words exactly as before once loaded into today's trainer; a new word
    starts as its synonym ("big" as "large")."""
    old = _train(family, 3)
    vocab, merges = clip_vocab(num_merges=None, corpus=f"{CORPUS} red circle large")
    old.tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)
    old.text_encoder = build_text_encoder(old.tokenizer, 3)
    if isinstance(old, FluxTrainer):
        old.tokenizer_2 = t5_tokenizer(max_length=T5_TOKENS, extra_words="red circle large")
        torch.manual_seed(3)
        fields = t5_config_fields(old.tokenizer_2, d_model=TEXT_DIM, d_kv=16, d_ff=2 * TEXT_DIM)
        old.text_encoder_2 = T5EncoderModel(T5Config(**fields, dropout_rate=0.0))
    old.pipeline().save_pretrained(tmp_path / "old", safe_serialization=True)
    new = family(build_autoencoder(0).eval().requires_grad_(False), 4)
    init_from(new, tmp_path / "old")
    pairs = [("tokenizer", "text_encoder")] + (
        [("tokenizer_2", "text_encoder_2")] * isinstance(old, FluxTrainer)
    )
    for tokenizer, encoder in pairs:
        assert len(getattr(new, tokenizer)) > len(getattr(old, tokenizer))
        with torch.no_grad():
            before, after = (
                _encode(getattr(t, tokenizer), getattr(t, encoder), "a large red circle") for t in (old, new)
            )
            big, large = (_encode(new.tokenizer, new.text_encoder, word) for word in ("big", "large"))
        assert torch.allclose(before, after)
        assert torch.allclose(big, large)


def _encode(tokenizer: Any, encoder: torch.nn.Module, text: str) -> torch.Tensor:
    ids = tokenizer([text], return_tensors="pt").input_ids
    states: torch.Tensor = encoder(ids)[0]
    return states


def test_the_learning_rate_warms_up_then_stays_or_decays_to_its_floor() -> None:
    constant = LoopConfig(steps=1000, warmup=100)
    decaying = LoopConfig(steps=1000, warmup=100, learning_rate=1e-3, min_learning_rate=1e-5)
    assert _rate(constant, 0) == _rate(decaying, 0) == pytest.approx(0.01)
    assert _rate(constant, 999) == 1.0
    assert _rate(decaying, 100) == pytest.approx(1.0)
    assert _rate(decaying, 550) == pytest.approx((1 + 0.01) / 2)
    assert _rate(decaying, 1000) == pytest.approx(0.01)
