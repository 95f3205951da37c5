"""How each `key=values` option of a workload mix reads: the `Mix` field it sets and the
parser of one of its comma-separated values (ValueError naming what is wrong)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^(\d+)x(\d+)$")


@dataclass(frozen=True, slots=True)
class Deadline:
    """A deadline as written: `value` seconds, or (`relative`) `value` times the request's
    alone time, measured in the same run."""

    value: float
    relative: bool = False

    def describe(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}"


def parse_deadline(text: str) -> Deadline | None:
    """`2.5` (seconds), `2x` (times the alone time) or `none`."""
    if text == "none":
        return None
    relative = text.endswith("x")
    try:
        value = float(text[:-1] if relative else text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"deadline must be seconds (2.5), a multiple of the alone time (2x) or none, got {text!r}"
        )
    return Deadline(value, relative)


def parse_size(text: str) -> tuple[int, int] | None:
    if text == "auto":
        return None
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"size must look like 64x64 (or auto), got {text!r}")
    return int(match[1]), int(match[2])


def _strength(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"strength must be above 0 and at most 1, got {text!r}")
    return value


def _partials(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ValueError(f"partials must be 0 to 3, got {text!r}")
    return int(text)


def _priority(text: str) -> int | None:
    if text == "default":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"priority must be an integer (lower runs first) or default, got {text!r}") from None


def _positive_int(key: str, item: str) -> int:
    value = int(item)
    if value < 1:
        raise ValueError(f"{key} values must be >= 1, got {item}")
    return value


# Each mix option: the `Mix` field it sets, and how one of its comma-separated values reads.
OPTIONS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "size": ("sizes", lambda _key, item: parse_size(item)),
    # default: each server's own (`--default-steps`), to time what a contender's steps cost.
    "steps": ("steps", lambda key, item: None if item == "default" else _positive_int(key, item)),
    "guidance": ("guidance", lambda _key, item: None if item == "default" else float(item)),
    "n": ("n", _positive_int),
    # Negative prompts (none = without one: no CFG where that switches it off).
    "negative": ("negative", lambda _key, item: None if item == "none" else item),
    # partial_images per request (streamed when above 0).
    "partials": ("partials", lambda _key, item: _partials(item)),
    # Image-to-image: how much of the input is redrawn.
    "strength": ("strength", lambda _key, item: None if item == "default" else _strength(item)),
    # A server of several models: the `model` each request names, drawn per request.
    "model": ("models", lambda _key, item: None if item == "default" else item),
    # Scheduling priority sent per request (default = not sent: the API key's own).
    "priority": ("priorities", lambda _key, item: _priority(item)),
    # Service level: seconds, or Nx times the request's alone time (measured in the run).
    "deadline": ("deadlines", lambda _key, item: parse_deadline(item)),
    # The ControlNet (a `--controlnet` name of the servers) a request uses with a control image
    # of its own; none = without: `controlnet=none,edges` controls half the requests.
    "controlnet": ("controlnets", lambda _key, item: None if item == "none" else item),
}
