"""The denoiser training loop every family shares: fresh batches from the seeded dataset,
AdamW, an exponential moving average of the weights, and the quality scorer on both
held-out sets (the template's and the phrasing set) every `eval_every` steps (the loss
says little about whether the model follows its captions); the average that scores best
on the two together is saved as a diffusers pipeline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from pipelines.trained.autoencoder import to_tensor
from pipelines.trained.dataset import sample_batch
from pipelines.trained.embeddings import carry_embeddings
from pipelines.trained.evaluate import PROMPT_SETS, evaluate, save_grid

# Share of captions replaced by "" so the model also learns the unconditional prediction
# classifier-free guidance subtracts.
CAPTION_DROPOUT = 0.1


class Trainer(Protocol):
    vae: Any

    def modules(self) -> dict[str, nn.Module]: ...
    def loss(
        self, latents: torch.Tensor, captions: list[str], generator: torch.Generator
    ) -> torch.Tensor: ...
    def pipeline(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class LoopConfig:
    steps: int
    seed: int = 0
    batch_size: int = 32
    learning_rate: float = 1e-3
    # With it, the rate falls from `learning_rate` to this along a cosine after the warm-up
    # (to settle a run, e.g. one continued from shipped weights); without it, it stays.
    min_learning_rate: float | None = None
    warmup: int = 100
    ema_decay: float = 0.998
    eval_every: int = 250
    eval_steps: int = 20
    eval_guidance: float = 4.0


class Average:
    """An exponential moving average of parameters (its decay warms up from 0)."""

    def __init__(self, modules: dict[str, nn.Module], decay: float) -> None:
        self.parameters = [p for m in modules.values() for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.parameters]
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for shadow, param in zip(self.shadow, self.parameters, strict=True):
            shadow.lerp_(param, 1 - decay)

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the modules for the duration (to sample or save)."""
        live = [p.detach().clone() for p in self.parameters]
        for param, shadow in zip(self.parameters, self.shadow, strict=True):
            param.copy_(shadow)
        try:
            yield
        finally:
            for param, saved in zip(self.parameters, live, strict=True):
                param.copy_(saved)


def train_denoiser(
    trainer: Trainer, config: LoopConfig, out: Path | None, log: Callable[[str], None]
) -> Average:
    """Train for `config.steps` steps; with `out`, score and save the best average there."""
    rng = np.random.default_rng(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    modules = trainer.modules()
    parameters = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _rate(config, step))
    average = Average(modules, config.ema_decay)
    scale = trainer.vae.config.scaling_factor
    best = -1.0
    started = time.monotonic()
    for step in range(1, config.steps + 1):
        for module in modules.values():
            module.train()
        images, captions, _ = sample_batch(rng, config.batch_size)
        captions = ["" if rng.random() < CAPTION_DROPOUT else c for c in captions]
        with torch.no_grad():
            latents = trainer.vae.encode(to_tensor(images)).latent_dist.mean * scale
        loss = trainer.loss(latents, captions, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        warmup.step()
        average.update()
        if step % 50 == 0:
            log(f"step {step} loss {loss.item():.4f} elapsed {time.monotonic() - started:.0f}s")
        if out is not None and (step % config.eval_every == 0 or step == config.steps):
            best = _checkpoint(
                trainer, average, config=config, out=out, step=step, best=best, started=started, log=log
            )
    return average


def _rate(config: LoopConfig, step: int) -> float:
    """The learning rate at `step` as a share of `config.learning_rate`."""
    if step < config.warmup or config.min_learning_rate is None:
        return min(1.0, (step + 1) / config.warmup)
    floor = config.min_learning_rate / config.learning_rate
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def init_from(trainer: Trainer, pipeline_dir: Path) -> None:
    """Start from a trained pipeline's weights (a `best/` directory or shipped weights):
    each trainable module loads the same-named component saved there; a text encoder's
    token embeddings move to the trainer's tokenizer, which may know more words than the
    one saved beside it (`carry_embeddings`)."""
    for name, module in trainer.modules().items():
        saved = type(module).from_pretrained(pipeline_dir / name)  # type: ignore[attr-defined]
        tokenizer_name = name.replace("text_encoder", "tokenizer")
        if name.startswith("text_encoder") and (pipeline_dir / tokenizer_name).is_dir():
            tokenizer = getattr(trainer, tokenizer_name)
            old_tokenizer = type(tokenizer).from_pretrained(pipeline_dir / tokenizer_name)
            module.load_state_dict(carry_embeddings(saved, old_tokenizer, tokenizer))
        else:
            module.load_state_dict(saved.state_dict())


def _checkpoint(
    trainer: Trainer,
    average: Average,
    *,
    config: LoopConfig,
    out: Path,
    step: int,
    best: float,
    started: float,
    log: Callable[[str], None],
) -> float:
    """Score the average on the held-out prompts; save it as the best if it scores best."""
    for module in trainer.modules().values():
        module.eval()
    with average.swapped_in():
        pipe = trainer.pipeline()
        merits, summaries = [], []
        for name in PROMPT_SETS:
            accuracy, pictures = evaluate(
                pipe, steps=config.eval_steps, guidance=config.eval_guidance, prompt_set=name
            )
            rates = accuracy.rates()
            merits.append(np.mean([rates["background"], rates["colour"], rates["shape"], rates["object"]]))
            summaries.append(f"{name}: {accuracy.summary()}")
            save_grid(pictures, out / f"samples-{step:06d}-{name}.png")
        merit = float(np.mean(merits))
        elapsed = time.monotonic() - started
        log(f"eval step {step} elapsed {elapsed:.0f}s {' | '.join(summaries)} merit {merit:.3f}")
        if merit > best:
            pipe.save_pretrained(out / "best", safe_serialization=True)
            (out / "best" / "score.txt").write_text(f"step {step}: " + "\n".join(summaries) + "\n")
            best = merit
    return best
