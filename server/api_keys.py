"""API keys and what each carries: `KEY` or `KEY:priority=N` (the scheduling priority of
the key's requests when they set none), several separated by commas or lines (a keys file).

A key is never echoed in an error: a bad entry is named by its position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.request import MAX_PRIORITY, MIN_PRIORITY

# `name=value` after a colon marks settings; a colon not followed by one stays in the key.
_SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*=")
KEY_SETTINGS = ("priority",)


@dataclass(frozen=True, slots=True)
class ApiKey:
    key: str
    priority: int = 0


def parse_api_keys(value: str | None) -> tuple[ApiKey, ...]:
    """Every key in `value`, with its settings; ValueError naming a bad entry's setting."""
    if value is None:
        return ()
    entries = [entry.strip() for entry in re.split(r"[,\n]", value)]
    return tuple(_parse(entry, position) for position, entry in enumerate(entries, 1) if entry)


def _parse(entry: str, position: int) -> ApiKey:
    key, *settings = entry.split(":")
    # Old keys containing a colon (no `name=` after it) keep working, whole.
    if not settings or not all(_SETTING.match(setting) for setting in settings):
        return ApiKey(entry)
    if not key.strip():
        raise ValueError(f"API key #{position} is empty before its settings")
    priority = 0
    for setting in settings:
        name, _, raw = setting.partition("=")
        if name not in KEY_SETTINGS:
            raise ValueError(
                f"API key #{position}: unknown setting {name!r} (known: {', '.join(KEY_SETTINGS)})"
            )
        try:
            priority = int(raw)
        except ValueError:
            raise ValueError(f"API key #{position}: priority must be an integer, got {raw!r}") from None
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(
                f"API key #{position}: priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority}"
            )
    return ApiKey(key.strip(), priority)
