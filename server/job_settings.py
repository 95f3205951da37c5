"""Where jobs and outputs are kept and for how long, as settings of `ServeSettings` (a base
it inherits, so each is a flag and a YAML key like the rest): the output directory, the
video job database (SQLite under it, or a shared PostgreSQL), leases and idempotency keys."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    output_dir: Path = Field(
        Path("outputs"),
        description="where URL images and videos (unless --output-url) and the video job "
        "database (unless --database-url) are kept",
    )
    image_url_ttl_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="how long response_format=url images stay"
    )
    video_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, allow_inf_nan=False, description="how long completed videos stay downloadable"
    )
    database_url: str | None = Field(
        None,
        description="keep video jobs in this PostgreSQL database (postgresql://USER:PASSWORD@HOST:PORT/NAME) "
        "instead of an SQLite file under --output-dir, so several servers share them: any server "
        "answers polls and DELETEs, a job whose server dies fails once its lease runs out (needs "
        "the [postgres] extra; default: SQLite)",
    )
    database_timeout_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="the longest a call to the video job database (PostgreSQL or SQLite) may take, "
        "waiting for the one before it included; past it the video routes and Idempotency-Key "
        "requests answer 503 job_store_unavailable, /health says the job store is unavailable, "
        "and image requests without the key carry on (a frozen database never stalls the server)",
    )
    job_lease_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="a server renews the lease of each video job it runs three times this often; "
        "a job whose lease runs out (its server died) is failed by any server sharing the database",
    )
    idempotency_window_s: float = Field(
        24 * 3600.0,
        gt=0,
        allow_inf_nan=False,
        description="how long an Idempotency-Key of POST /v1/videos (and remix) and the image POSTs "
        "is remembered: a retry with it returns the first request's video or answer instead of "
        "running again",
    )

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a PostgreSQL URL: postgresql://user:password@host:port/name")
        return value
