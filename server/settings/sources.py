"""Where serving settings come from, in order of precedence: built-in defaults < the YAML
preset (`--config FILE`) < `DIFFBATCH_<SETTING>` variables < command-line flags."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from server.settings.serve import ServeSettings


class SettingsError(ValueError):
    """A preset or flag is unknown or invalid; the message names it."""


ENV_PREFIX = "DIFFBATCH_"


def settings_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`DIFFBATCH_<SETTING>` variables (containers and Kubernetes set env, not flags), by
    setting name; values are strings, converted and checked like the YAML file's."""
    values = {}
    for name in ServeSettings.model_fields:
        value = environ.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            values[name] = value
    return values


def load_settings(
    config_file: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeSettings:
    """Defaults, then the YAML preset, then `DIFFBATCH_*` variables of `environ`, then
    explicit overrides (flags set on the command line)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(config_file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read config file {config_file}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"config file {config_file} must be a mapping of setting: value")
        values.update(loaded or {})
    values.update(settings_from_env(environ or {}))
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "api_key_file" in flags:  # a key file on the command line replaces a key from elsewhere
        values.pop("api_key", None)
    values.update(flags)
    try:
        return ServeSettings(**values)
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        source = f" in {config_file}" if config_file else ""
        raise SettingsError(f"invalid settings{source}: {problems}") from None


def _problem(err: Any) -> str:
    """One validation error as `setting: message` (a check across settings names its flags
    in its message, and has no setting of its own)."""
    message = "unknown setting" if err["type"] == "extra_forbidden" else str(err["msg"])
    message = message.removeprefix("Value error, ")
    where = ".".join(str(part) for part in err["loc"])
    return f"{where}: {message}" if where else message
