"""Where outputs go, as settings of `ServeSettings` (a base it inherits, so each is a flag and
a YAML key like the rest): the local directory by default, or an S3-compatible bucket."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OutputSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
