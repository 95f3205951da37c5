"""Tenants: an API key is a tenant (issue 39). A video job belongs to the key that created it,
stored as the key's keyed digest (`ApiKey.tenant`, never the key); a key sees its own jobs
only, an operator key (`KEY:admin`) every tenant's. Without keys the server has one tenant.

`Tenants` answers the two questions a route asks of a caller's key: whose is what it creates
(`of`), and whose jobs may it see (`seen_by`). The fair-share name the engine schedules by
(`server.key_limits.tenant_of`, `key#N`) is another, log-safe notion.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.api_keys import DEFAULT_PEPPER, ApiKey


@dataclass(frozen=True, slots=True)
class Tenants:
    """The tenant digests of one server: servers sharing a job database must share `pepper`
    (`--tenant-secret`), or each would find the others' jobs of a key to be another's."""

    pepper: bytes = DEFAULT_PEPPER

    @classmethod
    def from_secret(cls, secret: str | None) -> Tenants:
        return cls() if secret is None else cls(secret.encode())

    def of(self, key: ApiKey | None) -> str | None:
        """The tenant a request sent with `key` acts as (what its jobs store); None without keys."""
        return None if key is None else key.tenant(self.pepper)

    def seen_by(self, key: ApiKey | None) -> str | None:
        """The tenant whose jobs a request sent with `key` sees: its own; None (every job,
        those of no tenant too) for an admin key or without keys."""
        return None if key is None or key.admin else self.of(key)
