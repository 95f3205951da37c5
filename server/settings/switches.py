"""On/off settings as a YAML preset may write them: YAML 1.1 (PyYAML's `safe_load`) reads a
bare `on` / `off` (and `yes` / `no`) as a boolean, so `preemption: off` arrives as False. A
setting typed `Switch` (or `AutoSwitch`) reads a boolean as the word."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator


def switch_word(value: Any) -> Any:
    """`True` as "on", `False` as "off"; anything else as it is, for the field to check."""
    return ("on" if value else "off") if isinstance(value, bool) else value


Switch = Annotated[Literal["on", "off"], BeforeValidator(switch_word)]
AutoSwitch = Annotated[Literal["auto", "on", "off"], BeforeValidator(switch_word)]
