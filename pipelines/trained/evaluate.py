"""Score a shapes model on the fixed held-out prompts: `python -m pipelines.trained.evaluate DIR`.

Generates each prompt of a held-out set with its seed through the stock diffusers pipeline
and reads the pictures with `pipelines/trained/quality.py`: `template` is `HELD_OUT_PROMPTS` (the
template's phrasing, half of them asking for colour-shape pairs training never draws),
`phrasing` is `PHRASING_PROMPTS` (newcomers' phrasings, never trained on verbatim).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FluxPipeline
from PIL import Image

from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS, PHRASING_PROMPTS, PHRASING_SEEDS
from pipelines.trained.quality import Accuracy, score_all

# The held-out sets by name: prompts and their seeds.
PROMPT_SETS: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "template": (HELD_OUT_PROMPTS, HELD_OUT_SEEDS),
    "phrasing": (PHRASING_PROMPTS, PHRASING_SEEDS),
}


def generate(
    pipe: Any, prompts: list[str], seeds: list[int], *, steps: int, guidance: float, batch_size: int = 16
) -> list[np.ndarray]:
    """64x64 uint8 pictures of `prompts`, one generator per picture."""
    pipe.set_progress_bar_config(disable=True)
    pictures: list[np.ndarray] = []
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        output = pipe(
            prompts[chunk],
            generator=[torch.Generator().manual_seed(seed) for seed in seeds[chunk]],
            num_inference_steps=steps,
            height=64,
            width=64,
            output_type="np",
            **guidance_arguments(pipe, guidance, len(prompts[chunk])),
        )
        pictures += [(image * 255).round().clip(0, 255).astype(np.uint8) for image in output.images]
    return pictures


def guidance_arguments(pipe: Any, guidance: float, count: int) -> dict[str, Any]:
    """Classifier-free guidance at `guidance` in the family's own terms: FLUX calls it
    true CFG and needs a negative prompt (and is told its T5 length)."""
    if isinstance(pipe, FluxPipeline):
        return {
            "true_cfg_scale": guidance,
            "negative_prompt": [""] * count,
            "max_sequence_length": pipe.tokenizer_2.model_max_length,
        }
    return {"guidance_scale": guidance}


def evaluate(
    pipe: Any, *, steps: int, guidance: float, prompt_set: str = "template", repeat: int = 1
) -> tuple[Accuracy, list[np.ndarray]]:
    """The scores of `pipe` on the held-out set `prompt_set` (a `PROMPT_SETS` name), and its
    pictures; with `repeat`, each prompt is drawn that many times, with seeds s, s + 100, …
    (more pictures, less chance in the figures)."""
    prompts, seeds = PROMPT_SETS[prompt_set]
    every_prompt = [p for _ in range(repeat) for p in prompts]
    every_seed = [s + 100 * k for k in range(repeat) for s in seeds]
    with torch.no_grad():
        pictures = generate(pipe, every_prompt, every_seed, steps=steps, guidance=guidance)
    return score_all(pictures, every_prompt), pictures


def save_grid(pictures: list[np.ndarray], path: Path, columns: int = 8) -> None:
    """The pictures side by side, `columns` a row, enlarged 2x."""
    rows = [np.concatenate(pictures[i : i + columns], axis=1) for i in range(0, len(pictures), columns)]
    width = max(row.shape[1] for row in rows)
    rows = [np.pad(row, ((0, 0), (0, width - row.shape[1]), (0, 0))) for row in rows]
    grid = Image.fromarray(np.concatenate(rows, axis=0))
    grid.resize((grid.width * 2, grid.height * 2), Image.Resampling.NEAREST).save(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.trained.evaluate", description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument(
        "--prompts", choices=[*PROMPT_SETS, "both"], default="both", help="the held-out set(s) to score"
    )
    parser.add_argument("--repeat", type=int, default=1, help="draw each prompt N times (seeds +100 each)")
    parser.add_argument("--grid", type=Path, help="save the pictures here as one PNG (SET.png with both)")
    parser.add_argument("--vae", type=Path, help="decode with this autoencoder (a --stage decoder output)")
    args = parser.parse_args(argv)
    extra = {} if args.vae is None else {"vae": AutoencoderKL.from_pretrained(args.vae)}
    pipe = DiffusionPipeline.from_pretrained(args.model, **extra)
    names = list(PROMPT_SETS) if args.prompts == "both" else [args.prompts]
    for name in names:
        accuracy, pictures = evaluate(
            pipe, steps=args.steps, guidance=args.guidance, prompt_set=name, repeat=args.repeat
        )
        print(f"{name}: {accuracy.summary()}")
        if args.grid:
            grid = (
                args.grid.with_name(f"{args.grid.stem}-{name}{args.grid.suffix}")
                if len(names) > 1
                else args.grid
            )
            save_grid(pictures, grid)


if __name__ == "__main__":
    main()
