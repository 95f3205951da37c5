"""`--deadline-groups on|off`: a flag and a YAML key that reach the engine's config; any other
value stops start-up naming it."""

from __future__ import annotations

import pytest

from server.cli import build_parser
from server.settings import SettingsError, load_settings


def deadline_groups_from_flags(*flags: str) -> bool:
    args = build_parser().parse_args(["serve", "tiny-sd", *flags])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(None, overrides, {}).engine_config().deadline_groups


def test_deadline_groups_are_on_unless_turned_off() -> None:
    assert deadline_groups_from_flags() is True
    assert deadline_groups_from_flags("--deadline-groups", "off") is False
    assert load_settings(None, {"deadline_groups": "off"}).engine_config().deadline_groups is False


def test_another_value_is_refused_naming_the_setting() -> None:
    with pytest.raises(SettingsError, match="deadline_groups"):
        load_settings(None, {"deadline_groups": "sometimes"})
