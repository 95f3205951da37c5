"""`--preemption on|off`: a flag and a YAML key that reach the engine's step schedulers; any
other value stops start-up naming it."""

from __future__ import annotations

import pytest

from server.cli import build_parser
from server.settings import SettingsError, load_settings


def preemption_from_flags(*flags: str) -> bool:
    args = build_parser().parse_args(["serve", "tiny-sd", *flags])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(None, overrides, {}).engine_config().preemption


def test_preemption_is_on_unless_turned_off() -> None:
    assert preemption_from_flags() is True
    assert preemption_from_flags("--preemption", "off") is False
    assert load_settings(None, {"preemption": "off"}).engine_config().preemption is False


def test_another_value_is_refused_naming_the_setting() -> None:
    with pytest.raises(SettingsError, match="preemption"):
        load_settings(None, {"preemption": "sometimes"})
