"""`python -m pipelines.trained.train`: train the shapes models, deterministically from a seed.

    python -m pipelines.trained.train --stage vae --steps 600 --batch-size 16 --out runs/vae
    python -m pipelines.trained.train --family sd --vae runs/vae --steps 20000 --out runs/sd
    python -m pipelines.trained.train --family flux --vae runs/vae --steps 20000 --out runs/flux
    python -m pipelines.trained.train --family sd --init pipelines/trained/weights/shapes \
        --learning-rate 3e-4 --min-learning-rate 1e-5 --steps 10000 --out runs/sd-more

The autoencoder is trained once and shared by the families (`--stage decoder` sharpens its
decoder without moving its latent space); a denoiser stage trains the family's denoiser and
text encoders over the frozen autoencoder, scores samples every `--eval-every` steps with
`pipelines/trained/quality.py`, and keeps the best-scoring pipeline. The exact commands of the runs
measured so far are in docs/training.md (results depend on `--threads` too: CPU kernels
sum in an order that follows the thread count)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from pipelines.trained.autoencoder import train_autoencoder
from pipelines.trained.components import build_autoencoder
from pipelines.trained.flux import FluxTrainer
from pipelines.trained.loop import LoopConfig, init_from, train_denoiser
from pipelines.trained.sd import SDTrainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.trained.train", description=__doc__)
    parser.add_argument("--stage", choices=["vae", "decoder", "denoiser"], default="denoiser")
    parser.add_argument("--family", choices=["sd", "flux"], default="sd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--vae", type=Path, help="the trained autoencoder (a --stage vae output)")
    parser.add_argument(
        "--init",
        type=Path,
        help="go on training from saved weights: an autoencoder (--stage vae/decoder), or a "
        "trained pipeline directory such as a run's best/ or shipped weights (--stage denoiser)",
    )
    parser.add_argument(
        "--min-learning-rate",
        type=float,
        help="--stage denoiser: decay the learning rate along a cosine to this (default: constant)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train.log").open("a")

    def log(line: str) -> None:
        print(line, file=log_file, flush=True)
        print(line, file=sys.stderr, flush=True)

    if args.stage in {"vae", "decoder"}:
        start = (
            build_autoencoder(args.seed) if args.init is None else AutoencoderKL.from_pretrained(args.init)
        )
        vae = train_autoencoder(
            start,
            steps=args.steps,
            seed=args.seed,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            decoder_only=args.stage == "decoder",
            log=log,
        )
        vae.requires_grad_(True)  # Saved as trainable, like any freshly built model.
        vae.save_pretrained(args.out, safe_serialization=True)
        log(f"saved {args.out} scaling_factor {vae.config.scaling_factor:.4f}")
        return
    if args.vae is None and args.init is not None:
        args.vae = args.init / "vae"  # The autoencoder the saved denoiser was trained over.
    if args.vae is None:
        parser.error("--vae (or --init) is required to train a denoiser")
    vae = AutoencoderKL.from_pretrained(args.vae).eval().requires_grad_(False)
    trainer = SDTrainer(vae, args.seed) if args.family == "sd" else FluxTrainer(vae, args.seed)
    if args.init is not None:
        init_from(trainer, args.init)
    config = LoopConfig(
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        eval_every=args.eval_every,
        min_learning_rate=args.min_learning_rate,
    )
    log(f"training {args.family}: {config}")
    train_denoiser(trainer, config, args.out, log)


if __name__ == "__main__":
    main()
