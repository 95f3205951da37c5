"""API keys and what each carries: `KEY` or `KEY:setting=value:...`, several separated by
commas or lines (a keys file). Settings: `priority=N` (the scheduling priority of the key's
requests when they set none), `weight=W` (its fair share against other keys, default 1),
`max_queue=N` (most of its requests in the server at once) and `rate=R` (most requests a
second, with a burst of about a second's worth) — `server.key_limits` enforces those two —,
`slo=SECONDS` (the deadline of its requests when they set none), `webhook_secret=whsec_...`
(signs the events of the key's own `webhook_url`s) and the bare word `admin` (an operator
key: sees every tenant's video jobs).

A key is never echoed in an error: a bad entry is named by its position.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.request import MAX_PRIORITY, MIN_PRIORITY

# The key of the tenant digest when the operator sets none (`--tenant-secret`): the digest
# is then a plain domain-separated hash, as strong as the API keys are random.
DEFAULT_PEPPER = b"diffbatch tenant v1"

# `name=value` (or a known flag) after a colon marks settings; a colon followed by neither
# stays in the key.
_SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*=")
# Settings written as a bare word: the `ApiKey` field each sets to True.
_FLAGS = ("admin",)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key and its settings. A key's `name` in logs, metrics and bench reports is its
    position (`key#2`), never the key itself."""

    key: str
    position: int = 1
    priority: int = 0
    weight: float = 1.0
    max_queue: int | None = None
    rate: float | None = None
    # Seconds from arrival to the deadline of the key's requests (None: the server's timeout).
    slo: float | None = None
    # Signs the events sent to the key's own `webhook_url`s; a key without one names none.
    webhook_secret: str | None = None
    # An operator key: sees and manages every tenant's video jobs.
    admin: bool = False

    @property
    def name(self) -> str:
        return f"key#{self.position}"

    def tenant(self, pepper: bytes = DEFAULT_PEPPER) -> str:
        """The tenant this key is: a keyed digest of the key (never the key itself), the same
        on every server that shares the pepper, so a job store shared by several servers
        knows whose each job is. What is stored and logged for a key."""
        return hmac.new(pepper, self.key.encode(), hashlib.sha256).hexdigest()[:32]


def _priority(raw: str) -> int:
    try:
        priority = int(raw)
    except ValueError:
        raise ValueError(f"priority must be an integer, got {raw!r}") from None
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority}")
    return priority


def _positive_number(name: str) -> Callable[[str], float]:
    def read(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}") from None
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {raw!r}")
        return value

    return read


def _webhook_secret(raw: str) -> str:
    # The Standard Webhooks form: `whsec_` and the base64 of at least 24 random bytes.
    prefix, _, body = raw.partition("_")
    try:
        secret = base64.b64decode(body, validate=True)
    except binascii.Error:
        secret = b""
    if prefix != "whsec" or len(secret) < 24:
        raise ValueError("webhook_secret must be 'whsec_' and the base64 of at least 24 random bytes")
    return raw


def _max_queue(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"max_queue must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"max_queue must be at least 1, got {value}")
    return value


# Each setting a key may carry: its `ApiKey` field and how its text is read (ValueError
# saying what is wrong with it). A new setting is one row here and one field above.
_SETTINGS: dict[str, Callable[[str], object]] = {
    "priority": _priority,
    "weight": _positive_number("weight"),
    "max_queue": _max_queue,
    "rate": _positive_number("rate"),
    "slo": _positive_number("slo"),
    "webhook_secret": _webhook_secret,
}
KEY_SETTINGS = (*_SETTINGS, *_FLAGS)


def parse_api_keys(value: str | None) -> tuple[ApiKey, ...]:
    """Every key in `value`, with its settings; ValueError naming a bad entry's setting."""
    if value is None:
        return ()
    entries = [entry.strip() for entry in re.split(r"[,\n]", value)]
    return tuple(_parse(entry, position) for position, entry in enumerate(entries, 1) if entry)


def _parse(entry: str, position: int) -> ApiKey:
    key, *settings = entry.split(":")
    # Old keys containing a colon (no `name=` after it) keep working, whole.
    if not settings or not all(_SETTING.match(s) or s.strip() in _FLAGS for s in settings):
        return ApiKey(entry, position)
    if not key.strip():
        raise ValueError(f"API key #{position} is empty before its settings")
    values: dict[str, object] = {}
    for setting in settings:
        if setting.strip() in _FLAGS:
            values[setting.strip()] = True
            continue
        name, _, raw = setting.partition("=")
        if name not in _SETTINGS:
            raise ValueError(
                f"API key #{position}: unknown setting {name!r} (known: {', '.join(KEY_SETTINGS)})"
            )
        try:
            values[name] = _SETTINGS[name](raw)
        except ValueError as error:
            raise ValueError(f"API key #{position}: {error}") from None
    return ApiKey(key.strip(), position, **values)  # type: ignore[arg-type]
