"""The `diffbatch` command: `diffbatch serve [MODEL] [--flags]` and `diffbatch bench [--flags]`.

Flags are generated from `ServeSettings`, so every setting has a flag, a YAML key and one
help text. Values are validated by the settings model, which names what is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from engine.logs import configure_logging
from pipelines.denoiser.options import DenoiserSettingError
from pipelines.denoiser.options import check_packages as check_denoiser_packages
from pipelines.local_index import local_components
from pipelines.memory.options import (
    MemorySettingError,
    check_components,
    check_packages,
    check_transformer_file,
)
from pipelines.pipeline_class import PipelineClassError, check_class
from pipelines.trained.shipped import MissingWeightsError, is_shipped_model, shipped_model_dir
from server.settings import ServeSettings, SettingsError, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffbatch", description="OpenAI-compatible server for diffusion models, with request batching."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve MODEL at /v1/images/generations. Settings: defaults < --config FILE < flags.",
    )
    serve.add_argument("model", nargs="?", help=_help("model"))
    serve.add_argument("--config", type=Path, help="YAML preset with the same settings as these flags")
    # A section per `help_section`, in the order of the settings (`ServeSettings.sections`).
    sections: dict[str, list[str]] = {}
    for group in ServeSettings.sections():
        sections.setdefault(group.help_section, []).extend(group.model_fields)
    for title, names in sections.items():
        arguments = serve.add_argument_group(title)
        for name in names:
            if name != "model":
                _add_flag(arguments, name)
    # Parsed by bench.cli itself (main hands it the rest of the command line).
    commands.add_parser(
        "bench", add_help=False, help="benchmark contenders side by side (diffbatch bench --help)"
    )
    return parser


def _add_flag(group: argparse._ArgumentGroup, name: str) -> None:
    """The flag of setting `name`: its help text, its choices, a switch, or a list."""
    field = ServeSettings.model_fields[name]
    option: dict[str, Any] = {"help": _help(name), "default": None}
    choices = _literal_choices(field.annotation)
    if choices:
        option["choices"] = choices
    if field.annotation is bool:  # a switch: --disable-docs
        option.update(action="store_const", const=True)
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if typing.get_origin(field.annotation) in (dict, list):  # --lora-modules a=path b=path
        # Repeatable too: --component-dtypes vae=float32 --component-dtypes text_encoder=bfloat16
        option.update(nargs="+", action="extend", metavar=str(extra.get("metavar", "NAME=SOURCE")))
    flags = [f"--{name.replace('_', '-')}"]
    if name == "models":  # --model a=shapes --model b=tiny-sd (MODEL is then not needed)
        flags.insert(0, "--model")
    group.add_argument(*flags, dest=name, **option)


def _help(name: str) -> str:
    field = ServeSettings.model_fields[name]
    text = str(field.description)
    if "default" not in text:  # some descriptions say what their None default means
        text += f" (default: {field.default})"
    return text.replace("%", "%%")


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(choice) for choice in typing.get_args(annotation)]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        try:
            from bench.cli import main as bench_main
        except ImportError:  # a server-only install (the Docker image) has no bench package
            print("diffbatch bench needs a source checkout installed with the [bench] extra", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        settings = load_settings(args.config, overrides, os.environ)
    except SettingsError as exc:
        print(f"diffbatch: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def serve(settings: ServeSettings) -> int:
    # First: in JSON, whatever the checks below import (torch, with its own log handlers) and
    # print must find the JSON handler and the stray-line streams in place.
    configure_logging(settings.log_format, settings.log_level)
    try:  # a shipped model without its weights: one clear line, before any loading starts
        for each in settings.per_model():
            check_shipped_weights(each.model)
    except MissingWeightsError as exc:
        print(f"diffbatch: {exc}", file=sys.stderr)
        return 2
    if settings.ray_address is not None:  # the replicas check the backend packages as they load
        return _serve_on_ray(settings)
    try:  # a backend package missing, a flag the model refuses: one clear line, before listening
        for each in settings.per_model():
            check_model(each)
    except (MemorySettingError, DenoiserSettingError, PipelineClassError) as exc:
        print(f"diffbatch: {exc}", file=sys.stderr)
        return 2
    # After argument parsing: --help stays instant.
    from server.jobs.opening import JobStoreUnavailableError, check_database
    from server.output_dir import OutputDirLockedError, lock_output_dir
    from server.outputs.opening import check_output_store
    from server.outputs.store import OutputStoreError

    try:
        if settings.database_url is not None:
            check_database(settings.database_url)
        check_output_store(settings)
        # Jobs in a shared database are safe from a second server on the same directory (it
        # fails only lapsed leases, and file cleanup follows the shared rows), so servers
        # sharing a database may share an output directory too; with SQLite, one each.
        lock = lock_output_dir(settings.output_dir) if settings.database_url is None else nullcontext()
    except (OutputDirLockedError, JobStoreUnavailableError, OutputStoreError) as exc:
        print(f"diffbatch: {exc}", file=sys.stderr)
        return 2

    with lock:
        if settings.api_server_count > 1:  # the engine in a process of its own, N HTTP processes
            from server.api_servers.supervisor import serve_api_servers

            return serve_api_servers(settings)
        return _serve_here(settings)


def _serve_here(settings: ServeSettings) -> int:
    """The app and its engine in this process, until a shutdown signal; 2 when loading the
    model failed on a refused setting, 1 on any other failure to load."""
    from server.app import create_app, refused_flag
    from server.listening import run_app

    app = create_app(settings)
    run_app(app, settings)
    error = app.state.startup_error
    if error is not None and refused_flag(error) is not None:  # as the checks before listening
        print(f"diffbatch: {error}", file=sys.stderr)
        return 2
    return 1 if error is not None else 0


def _serve_on_ray(settings: ServeSettings) -> int:
    try:
        from server.ray_serve.app import check_no_bound_secrets
        from server.ray_serve.launch import serve_on_ray
    except ImportError as exc:
        print(f"diffbatch: --ray-address needs the [ray] extra ({exc})", file=sys.stderr)
        return 2
    try:
        check_no_bound_secrets(settings)
    except SettingsError as exc:
        print(f"diffbatch: {exc}", file=sys.stderr)
        return 2
    # The database is checked by the gateway as it starts, from the cluster's network.
    return serve_on_ray(settings)


def check_model(settings: ServeSettings) -> None:
    """What can be checked of one model before the server listens, cheaply: its backend
    packages, its `--transformer-file` (there, and GGUF or safetensors by its first bytes),
    its component names against its model index where that is on disk, and its
    `--pipeline-class`: imported where the pipeline loads in this process (the import the
    load makes anyway), else found without running it. What needs more (an index still to
    download, a class a worker imports) the loader refuses, and the server ends as here."""
    memory = settings.memory_config()
    check_packages(memory)
    check_denoiser_packages(settings.denoiser_config())
    check_transformer_file(memory)
    components = local_components(settings.model)
    if components is not None:
        check_components(memory, components)
    if settings.pipeline_class is not None:
        check_class(settings.pipeline_class, importing=settings.executor_kind == "thread")


def check_shipped_weights(model: str) -> None:
    """MissingWeightsError if `model` names a shipped trained model whose weights are not
    in this installation (`pipelines.trained.shipped`; torch-free)."""
    if is_shipped_model(model):
        shipped_model_dir(model)


if __name__ == "__main__":
    sys.exit(main())
