"""Settings: presets load, flags override files, bad values are named, and each setting is
grouped once (its `--help` section, and whether each of several models may set it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import build_parser
from server.settings import ServeSettings, SettingsError, load_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))

# What only the server sets: HTTP, jobs, outputs, webhooks, traces, Ray, several models, what
# the routes read before a request reaches a model, logging and shutdown.
SERVER_WIDE = {
    *(
        "host",
        "port",
        "api_server_count",
        "api_key",
        "api_key_file",
        "tenant_secret",
        "allowed_origins",
        "root_path",
    ),
    *("ssl_certfile", "ssl_keyfile", "disable_docs", "disable_playground", "access_log"),
    *("allowed_hosts", "public_url", "max_body_mb"),
    *("output_dir", "image_url_ttl_s", "video_ttl_s", "database_url", "database_timeout_s"),
    *("job_lease_s", "idempotency_window_s"),
    *("output_url", "s3_endpoint_url", "s3_region", "output_link_ttl_s", "proxy_content"),
    *("webhook_url", "webhook_secret", "allowed_webhook_hosts", "webhook_attempts"),
    *("webhook_backoff_s", "webhook_timeout_s"),
    *("otlp_traces_endpoint", "otlp_traces_protocol", "otlp_traces_sample_ratio"),
    *("ray_address", "replicas", "max_replicas", "ray_router", "gateway_replicas"),
    *("models", "models_memory_mb", "models_host_memory_mb", "ray_models_per_replica"),
    *("max_upload_pixels", "request_timeout_s", "video_timeout_s", "result_cache_mb"),
    *("result_cache_scope", "shutdown_timeout_s", "log_level", "log_format", "safety_checker"),
    *("gateway_cpus", "gateway_resources", "ray_resource_check", "ray_start_timeout_s"),
}
HELP_SECTIONS = [
    "model, batching and workers",
    "HTTP, TLS and API keys",
    "jobs, their files and idempotency",
    "fitting big models",
    "several models",
    "compiled denoisers and attention kernels",
    "object storage for outputs",
    "webhooks",
    "moderation",
    "traces (OpenTelemetry)",
    "several gateways on Ray Serve",
    "placing and starting on Ray Serve",
]


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.name)
def test_every_preset_is_valid(preset: Path) -> None:
    settings = load_settings(preset)
    assert settings.model and settings.served_model_name
    settings.pipeline_config()
    settings.engine_config()


def test_flags_override_the_file_which_overrides_defaults(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max_num_seqs: 4\nport: 9000\n")
    settings = load_settings(config, {"max_num_seqs": "16", "host": None})
    assert settings.max_num_seqs == 16 and settings.port == 9000 and settings.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("max_num_seq: 4\n", "max_num_seq: unknown setting"),
        ("request_batch_max_wait_ms: .nan\n", "request_batch_max_wait_ms"),
        ("default_size: big\n", "default_size"),
        ("- a list\n", "must be a mapping"),
        ("database_url: mysql://db/jobs\n", "database_url"),
        ("job_lease_s: 0\n", "job_lease_s"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, content: str, fragment: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(SettingsError, match=fragment):
        load_settings(config)


def test_on_off_switches_may_be_bare_yaml_words(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare on/off as a boolean: every switch takes it as the word.
    config = tmp_path / "c.yaml"
    switches: tuple[str, ...] = ("preemption", "deadline_groups", "deadline_admission", "decode_overlap")
    switches += ("vae_tiling", "compile")  # compile: off|blocks|full, whose off may be bare too
    config.write_text("".join(f"{name}: off\n" for name in switches) + "profile_run: on\naccess_log: off\n")
    settings = load_settings(config)
    assert [getattr(settings, name) for name in switches] == ["off"] * len(switches)
    assert (settings.profile_run, settings.access_log) == ("on", "off")
    with pytest.raises(SettingsError, match="preemption"):
        load_settings(None, {"preemption": "sometimes"})


def test_an_api_key_is_never_empty_and_never_carries_whitespace(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="must not be empty"):
        load_settings(None, {"api_key": ""})
    assert load_settings(None, {"api_key": " sekrit\n"}).api_key == "sekrit"
    secret = tmp_path / "key"
    secret.write_text("from-a-file\n")  # as `echo KEY > file` writes it
    assert load_settings(None, {"api_key_file": secret}).api_key == "from-a-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        load_settings(None, {"api_key_file": tmp_path / "empty"})
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(None, {"api_key_file": tmp_path / "missing"})


def test_environment_variables_sit_between_the_file_and_the_flags(tmp_path: Path) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text("max_num_seqs: 2\nmax_queue_len: 10\nbatching: step\n")
    environ = {"DIFFBATCH_MAX_NUM_SEQS": "4", "DIFFBATCH_MAX_QUEUE_LEN": "20", "DIFFBATCH_API_KEY": "k"}
    settings = load_settings(preset, {"max_queue_len": 30}, environ)
    assert (settings.max_num_seqs, settings.max_queue_len, settings.batching) == (4, 30, "step")
    assert settings.api_keys == ("k",)
    with pytest.raises(SettingsError, match="max_num_seqs"):
        load_settings(None, {}, {"DIFFBATCH_MAX_NUM_SEQS": "many"})


def test_several_api_keys_and_tls_files_that_go_together(tmp_path: Path) -> None:
    assert load_settings(None, {"api_key": "old, new"}).api_keys == ("old", "new")
    with pytest.raises(SettingsError, match="go together"):
        load_settings(None, {"ssl_certfile": tmp_path / "cert.pem"})


def test_data_parallel_workers_get_a_device_each_and_share_the_cpu() -> None:
    one = load_settings(overrides={})
    assert one.executor_kind == "thread" and one.worker_devices() == ["cpu"]
    cpu = load_settings(overrides={"data_parallel_size": 2, "num_threads": 8})
    assert cpu.executor_kind == "process"
    assert [(c.device, c.num_threads) for c in cpu.worker_configs()] == [("cpu", 4), ("cpu", 4)]
    cuda = load_settings(overrides={"data_parallel_size": 3, "device": "cuda"})
    assert [c.device for c in cuda.worker_configs()] == ["cuda:0", "cuda:1", "cuda:2"]
    assert all(c.num_threads is None for c in cuda.worker_configs())
    listed = load_settings(overrides={"data_parallel_size": 2, "device": "cuda:1, cuda:3"})
    assert listed.worker_devices() == ["cuda:1", "cuda:3"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"data_parallel_size": 2, "executor": "thread"}, "use executor process"),
        ({"data_parallel_size": 2, "device": "cuda:1"}, "one device per worker"),
        ({"data_parallel_size": 3, "device": "cuda:0,cuda:1"}, "one device per worker"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
    ],
)
def test_impossible_worker_layouts_are_refused(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        load_settings(overrides=overrides)


def test_workers_may_take_as_long_to_load_as_the_flag_says() -> None:
    """A first load of a large model from a hub cache or a network disk can take many
    minutes: --worker-start-timeout-s (default an hour) reaches every worker."""
    from server.app import build_executors
    from server.cli import build_parser

    flags = ["serve", "--data-parallel-size", "2", "--worker-start-timeout-s", "7200"]
    args = vars(build_parser().parse_args(flags))
    settings = load_settings(overrides={k: v for k, v in args.items() if k not in ("command", "config")})
    executors = build_executors(settings)
    assert [e.start_timeout_s for e in executors] == [7200, 7200]  # type: ignore[attr-defined]
    assert load_settings(overrides={}).worker_start_timeout_s == 3600
    with pytest.raises(SettingsError, match="worker_start_timeout_s"):
        load_settings(overrides={"worker_start_timeout_s": 0})


def test_the_job_database_comes_from_yaml_or_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("database_url: postgresql://diffbatch@db/jobs\njob_lease_s: 10\n")
    settings = load_settings(config)
    assert (settings.database_url, settings.job_lease_s) == ("postgresql://diffbatch@db/jobs", 10)
    from_env = load_settings(None, {}, {"DIFFBATCH_DATABASE_URL": "postgres://x@y/z"})
    assert from_env.database_url == "postgres://x@y/z"


def test_each_setting_is_declared_by_one_group() -> None:
    declared = [name for group in ServeSettings.sections() for name in group.model_fields]
    assert sorted(declared) == sorted(ServeSettings.model_fields)


def test_a_model_of_several_may_set_the_settings_of_its_groups_only(tmp_path: Path) -> None:
    groups = ServeSettings.sections()
    assert {name for group in groups if not group.each_model for name in group.model_fields} == SERVER_WIDE
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n  - {name: a, model: tiny-sd, max_num_seqs: 2, compile: blocks}\n")
    (own,) = load_settings(config).per_model()
    assert (own.max_num_seqs, own.compile) == (2, "blocks")


def test_help_has_a_section_per_group_title_in_order() -> None:
    text = _serve_help()
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles[2:] == HELP_SECTIONS  # after the positional arguments and the options


def _serve_help() -> str:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    assert isinstance(commands.choices, dict)
    return str(commands.choices["serve"].format_help())


def test_several_api_processes_refuse_ray_and_take_the_result_cache_and_key_limits() -> None:
    ray = {"ray_address": "auto"}
    assert load_settings(None, {**ray, "api_server_count": 1}).api_server_count == 1
    with pytest.raises(SettingsError, match="--gateway-replicas"):
        load_settings(None, {**ray, "api_server_count": 2})
    # Counted and kept once, in the engine process (`server.api_servers.key_limits_client`).
    shared = {"result_cache_mb": 64, "api_key": "k1:rate=5:max_queue=2,k2", "api_server_count": 2}
    assert load_settings(None, shared).api_server_count == 2
