"""`python -m pipelines.trained.ship`: a run's best pipeline goes into the package layout with
only what loading needs, every file of it is package data, and a wrong model is refused.

Runs on untrained stand-ins (tests/standin.py): the shape of the files, not their quality."""

from __future__ import annotations

import glob
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

from pipelines.trained.ship import main, ship
from tests.standin import build_standin

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KEPT = {
    "model_index.json",
    "score.txt",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
}


def files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def training_run(directory: Path, name: str = "shapes", seed: int = 0) -> Path:
    """What a training run leaves: a log, sample grids, and `best/` with extras loading ignores."""
    best = build_standin(directory / "best", name, seed)
    (directory / "train.log").write_text("eval step 250 ...\n")
    (directory / "samples-000250.png").write_bytes(b"png")
    (best / "score.txt").write_text("step 250: background 50%\n")
    component = "unet" if name == "shapes" else "transformer"
    weights = best / component / "diffusion_pytorch_model.safetensors"
    shutil.copy(weights, weights.with_name("diffusion_pytorch_model.fp16.safetensors"))
    weights.with_name("diffusion_pytorch_model.bin").write_bytes(b"a pickle")
    return directory


def weights_of(pipe: DiffusionPipeline) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for key, value in module.state_dict().items()
    }


def test_a_run_is_shipped_with_only_what_loading_needs(tmp_path: Path) -> None:
    run = training_run(tmp_path / "run")
    target = ship(run, "shapes", root=tmp_path / "weights")
    assert target == tmp_path / "weights" / "shapes"
    assert files(target) == KEPT
    assert (target / "score.txt").read_text() == "step 250: background 50%\n"
    shipped, source = (
        DiffusionPipeline.from_pretrained(target),
        DiffusionPipeline.from_pretrained(run / "best"),
    )
    expected = weights_of(source)
    assert all(torch.equal(value, expected[key]) for key, value in weights_of(shipped).items())
    assert all(value.dtype == torch.float32 for value in expected.values())


def test_every_shipped_file_is_package_data(tmp_path: Path) -> None:
    package = tmp_path / "pipelines" / "trained"
    for name in ("shapes", "shapes-dit"):
        ship(training_run(tmp_path / name, name), name, root=package / "weights")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pipelines.trained"]
    matched = {path for pattern in patterns for path in glob.glob(pattern, root_dir=package, recursive=True)}
    assert matched == {str(Path("weights") / path) for path in files(package / "weights")}


def test_shipping_again_replaces_the_model(tmp_path: Path) -> None:
    first = ship(training_run(tmp_path / "a", seed=0), "shapes", root=tmp_path / "weights")
    before = weights_of(DiffusionPipeline.from_pretrained(first))
    again = ship(training_run(tmp_path / "b", seed=1), "shapes", root=tmp_path / "weights")
    after = weights_of(DiffusionPipeline.from_pretrained(again))
    assert not all(torch.equal(before[key], after[key]) for key in before)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["shapes"]  # nothing left over


def test_the_wrong_family_or_no_pipeline_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = training_run(tmp_path / "run", "shapes")
    assert main([str(run), "shapes-dit", "--root", str(tmp_path / "weights")]) == 2
    assert "shapes-dit ships a FluxPipeline" in capsys.readouterr().err
    assert main([str(tmp_path), "shapes", "--root", str(tmp_path / "weights")]) == 2
    assert "no diffusers pipeline" in capsys.readouterr().err
    assert not (tmp_path / "weights" / "shapes-dit").exists()


def test_a_decoder_over_another_latent_space_is_refused(tmp_path: Path) -> None:
    run = training_run(tmp_path / "run", "shapes-dit")
    vae = DiffusionPipeline.from_pretrained(run / "best").vae
    vae.register_to_config(scaling_factor=0.5, shift_factor=None)
    vae.save_pretrained(tmp_path / "other-vae")
    with pytest.raises(ValueError, match="not the autoencoder the denoiser was trained over"):
        ship(run, "shapes-dit", vae=tmp_path / "other-vae", root=tmp_path / "weights")
    vae.register_to_config(
        scaling_factor=DiffusionPipeline.from_pretrained(run / "best").vae.config.scaling_factor
    )
    vae.save_pretrained(tmp_path / "decoder")
    target = ship(run, "shapes-dit", vae=tmp_path / "decoder", root=tmp_path / "weights")
    assert DiffusionPipeline.from_pretrained(target).vae.config.shift_factor == 0.0  # FLUX's decode needs it
    assert (target / "score.txt").read_text().endswith(f"decoder: {tmp_path / 'decoder'}\n")
