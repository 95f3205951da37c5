"""The webhook settings, each a flag and a YAML key (`ServeSettings` inherits these groups):
where `video.completed` / `video.failed` events go and how they are
signed (Standard Webhooks), retried and bounded."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from server.cross_site import host_allowed
from server.settings.section import Section
from server.webhook_urls import parse_webhook_url

_SECRET = re.compile(r"whsec_[A-Za-z0-9+/]+={0,2}")


class WebhookSettings(Section):
    help_section = "webhooks"
    each_model = False

    webhook_url: str | None = Field(
        None,
        description="send video.completed and video.failed events (OpenAI's shape, signed per "
        "Standard Webhooks) to this URL (default: none)",
    )
    webhook_secret: str | None = Field(
        None,
        description="the signing secret of --webhook-url's events, whsec_BASE64 as Standard Webhooks "
        "writes it (a request's own webhook_url is signed with its API key's webhook_secret, or "
        "with this one when the server has no API keys; set it as DIFFBATCH_WEBHOOK_SECRET rather "
        "than a flag: flags show in process lists)",
    )
    allowed_webhook_hosts: str | None = Field(
        None,
        description="comma-separated host names (or *.domain) a request's own webhook_url may name "
        "(POST /v1/videos); requests may name none by default, since the server would call any URL "
        "they gave it",
    )
    webhook_attempts: int = Field(
        8,
        ge=1,
        le=50,
        description="attempts to deliver one event before giving up (a 2xx answer ends them)",
    )
    webhook_backoff_s: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="wait before the second attempt; doubled before each further one, at most 10 minutes",
    )
    webhook_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description="the most one delivery attempt may take, from connecting to the answer's status "
        "(its body is never read); past it the attempt has failed",
    )

    @field_validator("webhook_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_webhook_url(value)  # ValueError saying what httpx would refuse
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _check_secret(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        # The library decodes leniently (it skips characters that are not base64), so a typo
        # would silently become another key: check the format here.
        if not _SECRET.fullmatch(value) or len(value) < len("whsec_") + 24:
            raise ValueError(
                "must be whsec_ followed by the base64 of at least 18 random bytes (Standard "
                "Webhooks' secret format)"
            )
        return value

    @model_validator(mode="after")
    def _secret_when_sending(self) -> WebhookSettings:
        # A request's own webhook_url is signed by its API key's webhook_secret: allowed hosts
        # alone need no server secret.
        if self.webhook_url and self.webhook_secret is None:
            raise ValueError(
                "webhook_secret is needed with webhook_url: every event is signed (generate one: "
                'python -c "import base64, os; '
                "print('whsec_' + base64.b64encode(os.urandom(24)).decode())\")"
            )
        if self.webhook_secret is not None or self.allowed_webhook_hosts:
            try:
                import standardwebhooks  # noqa: F401
            except ImportError as exc:
                raise ValueError(f"webhooks need the [webhooks] extra (standardwebhooks): {exc}") from None
        return self

    @property
    def allowed_webhook_host_list(self) -> list[str]:
        return [h.strip() for h in (self.allowed_webhook_hosts or "").split(",") if h.strip()]

    def webhook_host_allowed(self, host: str) -> bool:
        allowed = self.allowed_webhook_host_list
        return bool(allowed) and host_allowed(host, allowed)
