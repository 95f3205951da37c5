"""Where jobs and outputs are kept and for how long, each a flag and a YAML key
(`ServeSettings` inherits these groups): the output directory, the video job database
(SQLite under it, or a shared PostgreSQL), leases and idempotency keys; and outputs in an
S3-compatible bucket instead of the directory."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from server.settings.section import Section


class JobSettings(Section):
    help_section = "jobs, their files and idempotency"
    each_model = False

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


class OutputSettings(Section):
    """Where outputs go: the local directory by default (`--output-dir`), or an
    S3-compatible bucket."""

    help_section = "object storage for outputs"
    each_model = False

    output_url: str | None = Field(
        None,
        description="keep video files and response_format=url images in this S3-compatible bucket "
        "(s3://BUCKET/PREFIX) instead of --output-dir, so several servers serve them; credentials "
        "and region from the usual AWS environment variables (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL) or --s3-endpoint-url / --s3-region "
        "(default: --output-dir)",
    )
    s3_endpoint_url: str | None = Field(
        None,
        description="with --output-url: the S3 API's URL for a store other than AWS (MinIO, R2, "
        "Ceph: http://HOST:PORT) (default: AWS_ENDPOINT_URL, else AWS S3)",
    )
    s3_region: str | None = Field(
        None, description="with --output-url: the bucket's region (default: AWS_REGION, else us-east-1)"
    )
    output_link_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 24 * 3600.0,  # SigV4 presigned URLs live at most a week
        allow_inf_nan=False,
        description="with --output-url: how long the presigned URLs of url images and video "
        "downloads (/content redirects) stay valid",
    )
    proxy_content: bool = Field(
        False,
        description="with --output-url: stream files from the bucket through this server instead "
        "of answering with presigned URLs (clients that cannot reach the bucket)",
    )

    @field_validator("output_url")
    @classmethod
    def _check_output_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError("must be an S3 URL naming a bucket: s3://BUCKET or s3://BUCKET/PREFIX")
        return value

    def output_bucket(self) -> tuple[str, str]:
        """(bucket, key prefix ending in '/' or empty) of `output_url`."""
        assert self.output_url is not None
        parts = urlsplit(self.output_url)
        prefix = parts.path.strip("/")
        return parts.netloc, f"{prefix}/" if prefix else ""
