"""What a webhook URL may be, read by the HTTP client that will send to it, and how one is
written in logs.

A URL is checked with httpx's own parser, not `urllib.parse`: `urlsplit` silently drops
tabs and newlines and does not read the port, so a URL could pass an allow-list check and
then be refused by httpx at delivery time (an `InvalidURL`, which is not an
`httpx.HTTPError`). What passes here is what httpx will try to send to.
"""

from __future__ import annotations

import re

import httpx

# A host as httpx will resolve it (IDNA-encoded): a DNS name, an IPv4 or an IPv6 address.
# Anything else (percent-escapes, spaces that httpx escapes) is no host a resolver finds.
_HOST = re.compile(r"[A-Za-z0-9._:-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def parse_webhook_url(url: str) -> httpx.URL:
    """`url` as httpx reads it; ValueError saying what is wrong (a message for people)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"is not a URL the server can send to ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    host = parsed.raw_host.decode("ascii")
    if not _HOST.fullmatch(host):
        raise ValueError("must name a host (a DNS name or an IP address)")
    # httpx accepts any number here and fails only when connecting (an OverflowError).
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"has port {parsed.port}, which is not from 1 to 65535")
    return parsed


def webhook_host(url: httpx.URL) -> str:
    """The name the server will resolve and connect to (what an allow-list is matched against)."""
    return url.raw_host.decode("ascii").lower()


def redacted_url(url: str) -> str:
    """`url` as logs show it: no user name or password, no query or fragment (tokens often
    ride there), no control characters (which would forge log lines)."""
    try:
        parsed = parse_webhook_url(url)
    except ValueError:
        return _redacted_text(url)
    userinfo = "***@" if parsed.userinfo else ""
    host = parsed.raw_host.decode("ascii")
    if ":" in host:
        host = f"[{host}]"
    port = "" if parsed.port is None else f":{parsed.port}"
    path = parsed.raw_path.decode("ascii").split("?")[0]
    return f"{parsed.scheme}://{userinfo}{host}{port}{path}"


def _redacted_text(url: str) -> str:
    # A URL httpx cannot read: cut at the query, hide everything before the last '@' of
    # what is left (where a password would be), escape control characters.
    kept = re.split(r"[?#]", url, maxsplit=1)[0]
    scheme, separator, rest = kept.partition("://")
    if not separator:
        scheme, rest = "", kept
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    shown = f"{scheme}{separator}{rest}"
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], shown)
