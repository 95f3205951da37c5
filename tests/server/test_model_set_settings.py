"""Several models' settings: `--model NAME=SOURCE` repeated, a YAML `models:` list with each
model's own settings over the server's, and what a model may not set for itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import build_parser
from server.settings import SettingsError, load_settings


def settings_of(argv: list[str], config: Path | None = None):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["serve", *argv])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(config, overrides, {})


def test_model_flag_repeated_names_each_model_the_first_is_the_default() -> None:
    settings = settings_of(["--model", "img=tiny-sd", "--model", "vid=tiny-wan", "--max-num-seqs", "3"])
    assert [(e.name, e.model) for e in settings.models] == [("img", "tiny-sd"), ("vid", "tiny-wan")]
    assert settings.model_name == "img"
    vid = settings.per_model()[1]
    assert (vid.model, vid.model_name, vid.max_num_seqs) == ("tiny-wan", "vid", 3)


def test_several_models_behind_a_key_file_each_hold_its_key(tmp_path: Path) -> None:
    """The key read from --api-key-file reaches every model's settings: copying both the file
    and the key it gave into a model's settings once refused to start ("not both")."""
    key_file = tmp_path / "key"
    key_file.write_text("sk-one\n")
    argv = ["--model", "img=tiny-sd", "--model", "vid=tiny-wan", "--api-key-file", str(key_file)]
    settings = settings_of(argv)
    assert [own.api_key for own in settings.per_model()] == ["sk-one", "sk-one"]


def test_one_model_is_its_own_settings() -> None:
    settings = settings_of(["tiny-sd"])
    assert settings.models == [] and settings.per_model() == [settings]


def test_yaml_models_carry_their_own_settings_and_presets(tmp_path: Path) -> None:
    preset = tmp_path / "edit.yaml"
    preset.write_text("batching: request\nmax_num_seqs: 2\ndefault_steps: 3\n")
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 9000\nmodels:\n"
        "  - {name: a, model: tiny-sd, preload: true, offload: none}\n"
        f"  - {{name: b, model: tiny-sd, config: {preset}, max_num_seqs: 4}}\n"
    )
    settings = settings_of([], config)
    a, b = settings.per_model()
    assert settings.models[0].preload and not settings.models[1].preload
    assert (a.batching, a.max_num_seqs, a.port) == ("step", 8, 9000)
    # the preset, then the entry's own keys over it, then the server's for the rest
    assert (b.batching, b.max_num_seqs, b.default_steps, b.port) == ("request", 4, 3, 9000)


@pytest.mark.parametrize(
    ("models", "error"),
    [
        ("  - {name: a, model: tiny-sd, port: 1}\n", "port cannot differ between models"),
        (
            "  - {name: a, model: tiny-sd}\n  - {name: a, model: tiny-sd}\n",
            "each model name may be given once",
        ),
        ("  - {name: a, model: tiny-sd, max_num_seqs: 0}\n", "max_num_seqs"),
        ("  - {model: tiny-sd}\n", "name"),
        ("  - {name: a, model: tiny-sd, request_timeout_s: 5}\n", "request_timeout_s cannot differ"),
        # The host budget is the model set's: a model's own used to be taken, then ignored.
        ("  - {name: a, model: tiny-sd, models_host_memory_mb: 5}\n", "models_host_memory_mb cannot differ"),
        (
            "  - {name: a, model: tiny-sd, lora_modules: {b: tiny-lora-1}}\n  - {name: b, model: tiny-sd}\n",
            "b names more than one model or adapter",
        ),
        ("  - {name: flux.1, model: tiny-flux}\n  - {name: flux_1, model: tiny-flux}\n", "name them apart"),
    ],
)
def test_bad_models_are_refused_at_start_naming_the_setting(tmp_path: Path, models: str, error: str) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n" + models)
    with pytest.raises(SettingsError, match=error):
        settings_of([], config)


def test_a_model_flag_without_a_source_is_refused() -> None:
    with pytest.raises(SettingsError, match="NAME=SOURCE"):
        settings_of(["--model", "tiny-sd"])


def test_multiplexing_needs_several_models() -> None:
    with pytest.raises(SettingsError, match="--ray-models-per-replica"):
        settings_of(["tiny-sd", "--ray-models-per-replica", "2"])
    settings = settings_of(
        ["--model", "a=tiny-sd", "--model", "b=tiny-flux", "--ray-models-per-replica", "2"]
    )
    assert settings.ray_models_per_replica == 2
    assert all(own.ray_models_per_replica is None for own in settings.per_model())


def test_fixed_timesteps_take_commas_or_spaces_on_the_command_line() -> None:
    """`--timesteps 999,749,499,249` (as the variable is written) was refused: the flag's one
    argument was read as one integer."""
    for argv in (["--timesteps", "999,749,499,249"], ["--timesteps", "999", "749", "499", "249"]):
        assert settings_of(["tiny-sdxl", *argv]).timesteps == [999, 749, 499, 249]
