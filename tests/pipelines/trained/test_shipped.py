"""The shipped trained models by name: `shapes` and `shapes-dit` resolve to their folder in
the package and load like any model directory, with their own serving defaults; a missing
folder is explained; `diffbatch serve` with no model serves `shapes`.

Every test here builds its own weights folder (an untrained stand-in, tests/standin.py, or
an empty one), so they pass alike before and after the real weights are in the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import loading
from pipelines.trained import shipped
from pipelines.trained.shipped import SHIPPED_MODELS, MissingWeightsError, shipped_model_dir
from server.cli import build_parser
from server.settings import load_settings


def fake_model(root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    index = {"_class_name": SHIPPED_MODELS[name].pipeline_class}
    (directory / "model_index.json").write_text(json.dumps(index))
    return directory


@pytest.mark.parametrize("name", ["shapes", "shapes-dit"])
def test_a_shipped_name_resolves_to_its_folder_under_the_weights_root(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = fake_model(tmp_path, name)
    monkeypatch.setattr(shipped, "WEIGHTS_ROOT", tmp_path)
    assert loading.resolve_model_path(name) == str(directory)


def test_missing_weights_are_explained_with_the_command_that_ships_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shipped, "WEIGHTS_ROOT", tmp_path / "empty")
    with pytest.raises(MissingWeightsError, match=r"python -m pipelines.trained.ship RUN_DIR shapes-dit"):
        loading.resolve_model_path("shapes-dit")
    (tmp_path / "empty" / "shapes").mkdir(parents=True)  # a folder without model_index.json
    with pytest.raises(MissingWeightsError, match="tiny-sd"):
        shipped_model_dir("shapes")


def test_other_names_are_not_shipped_models(tmp_path: Path) -> None:
    assert loading.resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert loading.resolve_model_path("org/some-model") == "org/some-model"
    with pytest.raises(ValueError, match="unknown shipped model"):
        shipped_model_dir("shapes-xl")


def test_the_package_weights_folder_is_inside_the_package() -> None:
    # Where package data (pyproject.toml) ships from and `ship` writes to.
    assert Path(shipped.__file__).parent / "weights" == shipped.WEIGHTS_ROOT


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["serve"], "shapes"),
        (["serve", "--port", "0"], "shapes"),
        (["serve", "tiny-sd"], "tiny-sd"),
        (["serve", "shapes-dit", "--max-num-seqs", "4"], "shapes-dit"),
        (["serve", "/models/sd15"], "/models/sd15"),
    ],
)
def test_serve_with_no_model_serves_shapes_and_a_named_model_still_wins(argv: list[str], model: str) -> None:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = load_settings(None, overrides, {})
    assert settings.model == model and settings.model_name == model


def test_a_preset_or_the_environment_still_names_the_model(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("model: tiny-sd\n")
    assert load_settings(preset, {"model": None}, {}).model == "tiny-sd"
    assert load_settings(None, {"model": None}, {"DIFFBATCH_MODEL": "tiny-flux"}).model == "tiny-flux"
    assert load_settings(preset, {"model": "shapes-dit"}, {}).model == "shapes-dit"


def test_the_dockerfile_serves_shapes_and_copies_its_weights_into_the_image() -> None:
    root = Path(__file__).resolve().parents[3]
    dockerfile = (root / "Dockerfile").read_text()
    (command,) = [line for line in dockerfile.splitlines() if line.startswith("CMD ")]
    assert json.loads(command.removeprefix("CMD ")) == ["--config", "/opt/diffbatch/configs/shapes.yaml"]
    assert load_settings(root / "configs" / "shapes.yaml").model == "shapes"
    # The package (weights included) is copied into the build and installed with its data.
    assert "COPY pipelines/ pipelines/" in dockerfile
    ignored = (root / ".dockerignore").read_text().split()
    assert not any(
        "weights" in line or "safetensors" in line or line.startswith("pipelines") for line in ignored
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "adapter"),
    [("shapes", "StableDiffusionTextToImage"), ("shapes-dit", "FluxTextToImage")],
)
def test_a_shipped_name_loads_the_stand_in_with_its_serving_defaults(
    name: str, adapter: str, standin_weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.request import GenerationRequest, RequestBatch, SamplingParams
    from engine.worker.forward import run_batch
    from pipelines.base import PipelineConfig
    from pipelines.registry import load_pipeline

    monkeypatch.setattr(shipped, "WEIGHTS_ROOT", standin_weights)
    pipeline = load_pipeline(PipelineConfig(model=name, num_threads=1))
    assert type(pipeline).__name__ == adapter
    request = GenerationRequest.create("a small red circle on a white background", SamplingParams(seed=1))
    params = pipeline.resolve(request)
    # 64x64 as trained (FLUX's family default is 512x512) at the steps it was scored at.
    assert (params.width, params.height, params.num_inference_steps) == (64, 64, 20)
    if name == "shapes":
        assert params.guidance_scale == 4.0
    # Untrained weights: only the shape of the picture is checked, never what it shows.
    small = request.with_params(SamplingParams(seed=1, num_inference_steps=2, width=64, height=64))
    small = small.with_params(pipeline.resolve(small))
    batch = RequestBatch(pipeline.batch_key(small), (small,))
    output = run_batch(pipeline, batch).outputs[small.request_id]
    assert output.images[0].shape == (64, 64, 3)


@pytest.mark.slow
def test_the_flux_family_pads_t5_to_the_length_the_model_was_trained_on(
    standin_weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np
    import torch

    from engine.request import GenerationRequest, RequestBatch, SamplingParams
    from pipelines.base import PipelineConfig
    from pipelines.registry import load_pipeline

    monkeypatch.setattr(shipped, "WEIGHTS_ROOT", standin_weights)
    pipeline = load_pipeline(PipelineConfig(model="shapes-dit", num_threads=1))
    prompt = "a small red circle on a white background"
    request = GenerationRequest.create(prompt, SamplingParams(seed=3, num_inference_steps=2))
    request = request.with_params(pipeline.resolve(request))
    (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
    states = pipeline.prepare([request])
    while not states[0].is_done:
        pipeline.step(states)
    (stepped,) = pipeline.finish(states)
    pipe = pipeline.pipe  # type: ignore[attr-defined]
    stock = pipe(
        prompt,
        generator=[torch.Generator().manual_seed(alone.seeds[0])],
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        max_sequence_length=pipe.tokenizer_2.model_max_length,
        # Served with true CFG by default, at the scale it was scored at.
        negative_prompt=request.params.negative_prompt,
        true_cfg_scale=request.params.true_cfg_scale,
    ).images[0]
    assert (request.params.negative_prompt, request.params.true_cfg_scale) == (" ", 4.0)
    expected = (stock * 255).round().clip(0, 255).astype(np.int16)
    for served in (alone.images[0], stepped.images[0]):  # request level, step level
        assert int(np.abs(served.astype(np.int16) - expected).max()) <= 1


# On Ray too: the check runs before anything reaches the cluster (none listens there).
@pytest.mark.parametrize("where", [[], ["--ray-address", "127.0.0.1:9"]], ids=["local", "ray"])
def test_serve_without_the_weights_stops_at_once_with_one_clear_line(
    where: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.cli import main

    monkeypatch.setattr(shipped, "WEIGHTS_ROOT", tmp_path)
    assert main(["serve", "--output-dir", str(tmp_path / "outputs"), *where]) == 2
    error = capsys.readouterr().err
    assert error.startswith("diffbatch: the trained model 'shapes' has no weights")
    assert "python -m pipelines.trained.ship RUN_DIR shapes" in error and "Traceback" not in error
