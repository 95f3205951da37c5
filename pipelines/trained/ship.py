"""`python -m pipelines.trained.ship RUN_DIR NAME`: copy a trained run's best pipeline into
the package (`pipelines/trained/weights/NAME/`), where `diffbatch serve NAME` finds it.

    python -m pipelines.trained.ship runs/sd shapes
    python -m pipelines.trained.ship runs/flux shapes-dit --vae runs/decoder

RUN_DIR is a training run (its `best/` is shipped) or a pipeline directory itself. The
pipeline is loaded in float32 and saved again with diffusers' own `save_pretrained`, so
only what loading needs is kept: `model_index.json`, each component's config, tokenizer
files, and float32 safetensors (no pickles, no half-precision variants, no samples or
logs); `score.txt`, the run's note of which step was best and how it scored, goes along.
`--vae` swaps in an autoencoder whose decoder was trained further (`--stage decoder`); its
latent space must be the one the denoiser learned. The copy is checked to load before it
replaces what was there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from safetensors import safe_open

from pipelines.trained import shipped
from pipelines.trained.shipped import SHIPPED_MODELS

PROVENANCE = "score.txt"


def pipeline_dir(run_dir: Path) -> Path:
    """The pipeline a run left: `RUN_DIR/best` when there is one, else RUN_DIR itself."""
    for candidate in (run_dir / "best", run_dir):
        if (candidate / "model_index.json").is_file():
            return candidate
    raise FileNotFoundError(f"{run_dir} holds no diffusers pipeline (no model_index.json, nor best/)")


def ship(run_dir: Path, name: str, *, vae: Path | None = None, root: Path | None = None) -> Path:
    """Copy the run's pipeline to `root/name` (default: the package's weights folder)."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"unknown shipped model {name!r}; known: {', '.join(sorted(SHIPPED_MODELS))}")
    source = pipeline_dir(run_dir)
    pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=torch.float32)
    expected = SHIPPED_MODELS[name].pipeline_class
    if type(pipe).__name__ != expected:
        raise ValueError(f"{name} ships a {expected}, but {source} holds a {type(pipe).__name__}")
    notes = (source / PROVENANCE).read_text() if (source / PROVENANCE).is_file() else ""
    if vae is not None:
        pipe.vae = same_latent_space(pipe.vae, AutoencoderKL.from_pretrained(vae, torch_dtype=torch.float32))
        notes += f"decoder: {vae}\n"
    target = (root or shipped.WEIGHTS_ROOT) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        pipe.save_pretrained(staging, safe_serialization=True)
        if notes:
            (staging / PROVENANCE).write_text(notes)
        check_weights(staging)
        DiffusionPipeline.from_pretrained(staging)  # it loads, before it replaces anything
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def same_latent_space(current: AutoencoderKL, replacement: AutoencoderKL) -> AutoencoderKL:
    """`replacement`, refused unless it scales latents as `current` does (the denoiser learned
    those latents); FLUX's decode adds `shift_factor`, which must not be None."""
    if replacement.config.scaling_factor != current.config.scaling_factor:
        raise ValueError(
            f"--vae scales latents by {replacement.config.scaling_factor}, the pipeline's by "
            f"{current.config.scaling_factor}: it is not the autoencoder the denoiser was trained over"
        )
    if replacement.config.shift_factor is None and current.config.shift_factor is not None:
        replacement.register_to_config(shift_factor=current.config.shift_factor)
    return replacement


def check_weights(directory: Path) -> None:
    """Every weight file is a safetensors file of float32 tensors."""
    for path in directory.rglob("*"):
        if path.suffix in {".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5"}:
            raise ValueError(f"{path} is not safetensors")
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                    dtype = weights.get_slice(key).get_dtype()
                    if dtype != "F32":
                        raise ValueError(f"{path}: {key} is {dtype}, not float32")


def replace_dir(staging: Path, target: Path) -> None:
    """Put `staging` at `target`, removing what was there only once the new one is in place."""
    old = target.with_name(f".{target.name}-old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.trained.ship",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="a training run's --out folder, or a pipeline folder")
    parser.add_argument("name", choices=sorted(SHIPPED_MODELS))
    parser.add_argument("--vae", type=Path, help="decode with this autoencoder (a --stage decoder output)")
    parser.add_argument("--root", type=Path, help="write under this folder (default: the package's)")
    args = parser.parse_args(argv)
    try:
        target = ship(args.run_dir, args.name, vae=args.vae, root=args.root)
    except (OSError, ValueError) as exc:
        print(f"ship: {exc}", file=sys.stderr)
        return 2
    files = sorted(p for p in target.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"shipped {args.name}: {target} ({len(files)} files, {size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
