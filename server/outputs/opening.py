"""Open the output store the settings name: a bucket with `--output-url`, else `--output-dir`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.outputs.local import LocalOutputStore
from server.outputs.store import OutputStore, OutputStoreError
from server.settings import OutputSettings

# A start-up check should fail in seconds, not after botocore's default retries.
_CONNECT_TIMEOUT_S = 5.0


def open_output_store(settings: OutputSettings, output_dir: Path) -> OutputStore:
    """The store; no network call yet (`check_output_store` makes one at start-up)."""
    if settings.output_url is None:
        return LocalOutputStore(output_dir)
    from server.outputs.s3 import S3OutputStore

    bucket, prefix = settings.output_bucket()
    return S3OutputStore(
        s3_client(settings),
        bucket,
        prefix,
        link_lifetime_s=settings.output_link_ttl_s,
        proxy=settings.proxy_content,
    )


def s3_client(settings: OutputSettings, *, attempts: int = 3) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise OutputStoreError(f"--output-url needs S3 support: install diffbatch[s3] ({exc})") from None
    config = Config(
        connect_timeout=_CONNECT_TIMEOUT_S,
        retries={"max_attempts": attempts, "mode": "standard"},
        signature_version="s3v4",
        # Path-style URLs (http://host/bucket/key) work with every S3-compatible server;
        # virtual hosts (bucket.host) need DNS a local endpoint lacks.
        s3={"addressing_style": "path" if settings.s3_endpoint_url else "auto"},
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region, config=config
    )


def check_output_store(settings: OutputSettings) -> None:
    """At start-up, before anything loads: `OutputStoreError` (one line naming the flag)
    unless the bucket of `--output-url` exists and these credentials may use it."""
    if settings.output_url is None:
        return
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    bucket, _ = settings.output_bucket()
    client = s3_client(settings, attempts=1)
    where = client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise OutputStoreError(
            "--output-url: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE)"
        ) from None
    except EndpointConnectionError as exc:
        raise OutputStoreError(f"--s3-endpoint-url: cannot reach {where}: {exc}") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise OutputStoreError(f"--output-url: there is no bucket {bucket!r} at {where}") from None
        if code in ("403", "AccessDenied", "Forbidden"):
            raise OutputStoreError(
                f"--output-url: access to bucket {bucket!r} at {where} is denied: check the "
                "credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
            ) from None
        raise OutputStoreError(f"--output-url: bucket {bucket!r} at {where}: {exc}") from None
    except BotoCoreError as exc:  # a timeout, a malformed endpoint, ...
        raise OutputStoreError(f"--s3-endpoint-url: cannot use {where}: {exc}") from None
