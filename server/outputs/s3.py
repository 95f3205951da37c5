"""`S3OutputStore`: output files as objects in an S3-compatible bucket (`--output-url
s3://bucket/prefix`), through boto3, so every server sharing the job table serves them.

Clients fetch files from the bucket by presigned URLs (the server signs, the bucket
serves), or through the server when `--proxy-content` (a bucket clients cannot reach).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError
from starlette.responses import RedirectResponse, Response, StreamingResponse

from server.outputs.store import OutputStoreUnavailableError, StoredFile

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# DeleteObjects takes at most this many keys per call.
_DELETE_BATCH = 1000
_CHUNK = 1 << 16


class S3OutputStore:
    shared = True
    opens_late = False

    def __init__(self, client: Any, bucket: str, prefix: str, *, link_lifetime_s: float, proxy: bool) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix  # "" or ending in "/"
        self.link_lifetime_s = link_lifetime_s
        self.proxy = proxy
        self._reported: str | None = None  # the reason it is unavailable, once logged

    def _object(self, key: str) -> str:
        return self.prefix + key

    def _use(self, call: Callable[[], _T]) -> _T:
        """`call()` on the bucket; a bucket that is gone (or an endpoint that does not answer)
        is `OutputStoreUnavailableError` naming the store, its reason logged once an outage."""
        try:
            result = call()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchBucket":
                raise
            raise self._unavailable(f"its bucket {self.bucket!r} no longer exists") from None
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            raise self._unavailable(f"its endpoint cannot be reached ({exc})") from None
        self._reported = None
        return result

    def _unavailable(self, reason: str) -> OutputStoreUnavailableError:
        where = f"s3://{self.bucket}/{self.prefix}"
        if reason != self._reported:
            logger.error("the output store %s (--output-url) cannot be used: %s", where, reason)
            self._reported = reason
        return OutputStoreUnavailableError(
            f"the output store {where} cannot be used now; its operator can read why in the server log"
        )

    def write(self, key: str, data: bytes, media_type: str) -> None:
        # One PUT: S3 makes an object visible whole or not at all.
        self._use(
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._object(key), Body=data, ContentType=media_type
            )
        )

    def read(self, key: str) -> bytes:
        try:
            answer = self._use(lambda: self.client.get_object(Bucket=self.bucket, Key=self._object(key)))
        except ClientError as exc:
            if _missing(exc):
                raise FileNotFoundError(key) from None
            raise
        body = answer["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def delete(self, keys: Iterable[str]) -> None:
        objects = [{"Key": self._object(key)} for key in keys]
        for start in range(0, len(objects), _DELETE_BATCH):
            delete = {"Objects": objects[start : start + _DELETE_BATCH], "Quiet": True}
            self._use(lambda: self.client.delete_objects(Bucket=self.bucket, Delete=delete))  # noqa: B023

    def listing(self, prefix: str) -> Iterator[StoredFile]:
        pages = iter(
            self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._object(prefix)
            )
        )
        while (page := self._use(lambda: next(pages, None))) is not None:
            for entry in page.get("Contents", ()):
                key = entry["Key"][len(self.prefix) :]
                yield StoredFile(key, entry["LastModified"].timestamp())

    def modified(self, key: str) -> float | None:
        try:
            head = self._use(lambda: self.client.head_object(Bucket=self.bucket, Key=self._object(key)))
        except ClientError as exc:
            if _missing(exc):
                return None
            raise
        stamp: float = head["LastModified"].timestamp()
        return stamp

    def link(self, key: str, media_type: str, filename: str | None = None) -> str | None:
        if self.proxy:
            return None
        params = {"Bucket": self.bucket, "Key": self._object(key), "ResponseContentType": media_type}
        if filename is not None:
            params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
        # Signed here, without a round trip; the bucket checks the signature and the expiry.
        url: str = self.client.generate_presigned_url(
            "get_object", Params=params, ExpiresIn=int(self.link_lifetime_s)
        )
        return url

    def response(self, key: str, media_type: str, filename: str | None = None) -> Response | None:
        url = self.link(key, media_type, filename)
        if url is not None:
            # The bucket answers 404 itself for an object deleted meanwhile.
            return RedirectResponse(url, status_code=307)
        try:
            answer = self._use(lambda: self.client.get_object(Bucket=self.bucket, Key=self._object(key)))
        except ClientError as exc:
            if _missing(exc):
                return None
            raise
        headers = {"content-length": str(answer["ContentLength"])}
        if filename is not None:
            headers["content-disposition"] = f'attachment; filename="{filename}"'
        return StreamingResponse(_chunks(answer["Body"]), media_type=media_type, headers=headers)


def _chunks(body: Any) -> Iterator[bytes]:
    """The object's bytes as they arrive (Starlette iterates this in a worker thread)."""
    try:
        yield from body.iter_chunks(_CHUNK)
    finally:
        body.close()


def _missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")
