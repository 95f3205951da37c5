"""How the server meets HTTP, each a flag and a YAML key (`ServeSettings` inherits these
groups): where it listens, TLS, API keys, which origins and hosts it answers, and what it
exposes besides the API; and what its routes read before a request reaches a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from server.api_keys import ApiKey, parse_api_keys
from server.cross_site import default_allowed_hosts
from server.settings.section import MODEL_SECTION, Section
from server.settings.switches import switch_word


class HttpSettings(Section):
    help_section = "HTTP, TLS and API keys"
    each_model = False

    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0 for all)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one)")
    api_server_count: int = Field(
        1,
        ge=1,
        le=64,
        description="HTTP processes in front of one engine process, sharing the port (as vLLM's "
        "--api-server-count): parsing, encoding and HTTP scale past one core while one engine "
        "batches every request; 1 serves from one process, the engine in it",
    )
    api_key: str | None = Field(
        None,
        description="require 'Authorization: Bearer KEY' on /v1/* and /metrics, and hide /docs; "
        "several keys comma-separated (rotation, one per client); KEY:priority=N gives the key's "
        "requests that scheduling priority when they set none (lower runs first; default 0); "
        "KEY:weight=W its fair share against other keys (default 1), KEY:max_queue=N and "
        "KEY:rate=R (requests a second) its limits (429 past them); KEY:admin an operator key "
        "that sees every key's video jobs (each other key sees its own only); settings chain with ':'",
    )
    api_key_file: Path | None = Field(
        None,
        description="read the API key from this file (a Docker or Kubernetes secret); several keys "
        "one a line or comma-separated, each KEY or KEY:setting=value:... as --api-key",
    )
    tenant_secret: str | None = Field(
        None,
        description="the secret the server keys its record of which API key owns a video job with "
        "(a digest of the key, never the key); servers sharing --database-url must share it "
        "(default: a built-in one, as strong as the keys are random)",
    )
    allowed_origins: str | None = Field(
        None,
        description="comma-separated origins (https://app.example.com, or *) whose pages may call "
        "the API from a browser (CORS); none by default",
    )
    root_path: str = Field(
        "", description="the path prefix a reverse proxy serves this server under (e.g. /diffbatch)"
    )
    ssl_certfile: Path | None = Field(None, description="serve HTTPS with this certificate (PEM)")
    ssl_keyfile: Path | None = Field(None, description="the private key of --ssl-certfile (PEM)")
    disable_docs: bool = Field(
        False, description="no /docs, /redoc or /openapi.json (they are off anyway with an API key)"
    )
    disable_playground: bool = Field(
        False, description="no /playground page (the browser page that tries this server's API)"
    )
    access_log: Annotated[Literal["on", "quiet", "off"], BeforeValidator(switch_word)] = Field(
        "quiet", description="HTTP access log: on, quiet (all but /health and /metrics) or off"
    )
    allowed_hosts: str | None = Field(
        None,
        description="comma-separated host names (or *.domain, or *) this server answers to; others "
        "get 400 (default: the loopback names when bound to loopback without an API key, as a "
        "guard against DNS rebinding; any host otherwise)",
    )
    public_url: str | None = Field(
        None,
        description="the URL clients reach this server at (e.g. https://images.example.com behind "
        "a reverse proxy), used for response_format=url links (default: the address they connected to)",
    )
    max_body_mb: float = Field(50.0, gt=0, allow_inf_nan=False, description="largest request body (413)")

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        # Surrounding whitespace (a newline from a file or a shell) is never part of a key.
        if value is not None and not value.replace(",", "").strip():
            raise ValueError("must not be empty: leave it unset to serve without a key")
        parse_api_keys(value)  # a bad key setting stops start-up, naming it
        return None if value is None else value.strip()

    @model_validator(mode="before")
    @classmethod
    def _key_from_file(cls, values: Any) -> Any:
        path = values.get("api_key_file") if isinstance(values, dict) else None
        if path is None:
            return values
        if values.get("api_key") is not None:
            raise ValueError("set api_key or api_key_file, not both")
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"api_key_file: cannot read {path}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file: {path} is empty")
        return {**values, "api_key": key}

    @model_validator(mode="after")
    def _tls_pair(self) -> HttpSettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: set both or neither")
        return self

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(entry.key for entry in self.api_key_entries)

    @property
    def api_key_entries(self) -> tuple[ApiKey, ...]:
        """Each key with its settings (`server.api_keys`)."""
        return parse_api_keys(self.api_key)

    @property
    def allowed_origin_list(self) -> list[str]:
        return [o.strip().rstrip("/") for o in (self.allowed_origins or "").split(",") if o.strip()]

    @property
    def allowed_host_list(self) -> list[str]:
        if self.allowed_hosts:
            return [host.strip() for host in self.allowed_hosts.split(",") if host.strip()]
        return default_allowed_hosts(self.host, self.api_key is not None)


class RequestSettings(Section):
    """What the routes read from the server's settings before a request reaches a model (so
    no model of several sets them): its deadline, the largest upload, the result cache
    (`server.result_cache`). Listed in `--help` with the model's."""

    help_section = MODEL_SECTION
    each_model = False

    max_upload_pixels: int = Field(
        4096 * 4096, ge=1, description="largest width x height of an uploaded image (413 beyond)"
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, allow_inf_nan=False, description="per-request deadline in seconds; past it: 504"
    )
    video_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="deadline of a video job from its creation, in seconds; past it the job fails "
        "with code timeout and leaves the engine at the next step (step mode) or batch",
    )
    result_cache_mb: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="answer an exact repeat of an image request that sets a seed (same model, "
        "adapter, prompt, uploads and every parameter that changes its pixels; not timeout, "
        "priority, user or response_format) from an LRU of this many MiB of encoded images "
        "(0 = off); requests without a seed, and streamed ones, always run",
    )
    result_cache_scope: Literal["tenant", "global"] = Field(
        "tenant",
        description="whose answers the result cache shares: each API key its own (tenant; else "
        "a key could tell by the speed of its answer that another key already ran that exact "
        "prompt and seed), or every key (global: a server whose keys are one user's)",
    )
