"""An S3-compatible server for the tests: moto's server mode on loopback, on a free port,
driven through the real boto3 client over HTTP (not moto's in-process mock), so the
requests, signatures and presigned URLs are the ones a real bucket sees."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# moto's server accepts any credentials; these keep boto3 from looking for real ones.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint_url: str

    def client(self) -> Any:
        import boto3

        return boto3.session.Session(
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_REGION"],
        ).client("s3", endpoint_url=self.endpoint_url)

    def new_bucket(self) -> str:
        name = f"bucket-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        listed = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(entry["Key"] for entry in listed.get("Contents", ()))


def run_s3_server() -> Iterator[S3Server]:
    """Start moto's threaded server on 127.0.0.1 (port 0: the kernel picks a free one)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()
