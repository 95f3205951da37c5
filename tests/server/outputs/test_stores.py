"""Both output stores behind one suite: a directory, and a bucket on moto's S3 server
through the real boto3 client over HTTP."""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest.mock import patch

import httpx
import pytest

from server.image_store import ImageStore
from server.outputs.local import LocalOutputStore
from server.outputs.opening import check_output_store, open_output_store
from server.outputs.s3 import S3OutputStore
from server.outputs.store import OutputStore, OutputStoreError
from server.settings import OutputSettings
from tests.s3 import S3Server


def s3_settings(s3_server: S3Server, bucket: str, **values: object) -> OutputSettings:
    return OutputSettings.model_validate(
        {"output_url": f"s3://{bucket}/served/here", "s3_endpoint_url": s3_server.endpoint_url, **values}
    )


@pytest.fixture(params=["local", "s3"])
def outputs(request: pytest.FixtureRequest, tmp_path: Path) -> OutputStore:
    if request.param == "local":
        return LocalOutputStore(tmp_path)
    request.getfixturevalue("s3_credentials")
    s3_server: S3Server = request.getfixturevalue("s3_server")
    return open_output_store(s3_settings(s3_server, s3_server.new_bucket()), tmp_path)


def test_a_file_is_written_read_listed_and_deleted(outputs: OutputStore) -> None:
    before = time.time()
    outputs.write("videos/video_1.mp4", b"mp4", "video/mp4")
    outputs.write("videos/video_1.png", b"png", "image/png")
    outputs.write("images/other.png", b"png", "image/png")
    assert outputs.read("videos/video_1.mp4") == b"mp4"
    listed = sorted(outputs.listing("videos/video_"), key=lambda f: f.key)
    assert [f.key for f in listed] == ["videos/video_1.mp4", "videos/video_1.png"]
    # Within the clocks' resolution (S3 stamps whole seconds).
    assert all(before - 2 <= f.modified <= time.time() + 2 for f in listed)
    modified = outputs.modified("videos/video_1.mp4")
    assert modified is not None and outputs.modified("videos/nothing.mp4") is None
    outputs.delete(["videos/video_1.mp4", "videos/video_1.png", "videos/never.mp4"])
    assert [f.key for f in outputs.listing("videos/")] == []
    with pytest.raises(FileNotFoundError):
        outputs.read("videos/video_1.mp4")


def test_a_local_file_is_on_disk_before_its_write_returns(tmp_path: Path) -> None:
    """The data is synced before the rename puts it in place, and the directory after, so
    a completed job's files survive a power loss as its row does."""
    events: list[str] = []
    fsync, rename = os.fsync, Path.rename

    def synced(descriptor: int) -> None:
        events.append("directory" if os.path.isdir(f"/proc/self/fd/{descriptor}") else "file")
        fsync(descriptor)

    def renamed(path: Path, target: Path) -> Path:
        events.append("rename")
        return rename(path, target)

    with patch("os.fsync", synced), patch.object(Path, "rename", renamed):
        LocalOutputStore(tmp_path).write("videos/video_1.mp4", b"mp4", "video/mp4")
    assert events == ["file", "rename", "directory"]
    assert (tmp_path / "videos" / "video_1.mp4").read_bytes() == b"mp4"


def test_a_bucket_keeps_its_files_under_the_prefix(
    s3_server: S3Server, s3_credentials: None, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    outputs = open_output_store(s3_settings(s3_server, bucket), tmp_path)
    outputs.write("images/a.png", b"png", "image/png")
    assert s3_server.keys(bucket) == ["served/here/images/a.png"]
    assert not any(tmp_path.iterdir())  # nothing on the local disk


def test_a_bucket_file_is_served_by_a_presigned_url_or_through_the_server(
    s3_server: S3Server, s3_credentials: None, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    outputs = open_output_store(s3_settings(s3_server, bucket, output_link_ttl_s=600), tmp_path)
    outputs.write("videos/video_1.mp4", b"an mp4", "video/mp4")
    link = outputs.link("videos/video_1.mp4", "video/mp4", "video_1.mp4")
    assert link is not None and "X-Amz-Expires=600" in link and "X-Amz-Signature=" in link
    fetched = httpx.get(link)  # as a client would, without credentials
    assert fetched.content == b"an mp4" and fetched.headers["content-type"] == "video/mp4"
    assert 'filename="video_1.mp4"' in fetched.headers["content-disposition"]
    redirect = outputs.response("videos/video_1.mp4", "video/mp4")
    assert redirect is not None and redirect.status_code == 307

    proxied = open_output_store(s3_settings(s3_server, bucket, proxy_content=True), tmp_path)
    assert isinstance(proxied, S3OutputStore) and proxied.link("videos/video_1.mp4", "video/mp4") is None
    streamed = proxied.response("videos/video_1.mp4", "video/mp4", "video_1.mp4")
    assert streamed is not None and streamed.status_code == 200
    assert streamed.headers["content-length"] == "6"
    assert proxied.response("videos/gone.mp4", "video/mp4") is None


def test_expired_url_images_are_deleted(outputs: OutputStore) -> None:
    images = ImageStore(outputs, ttl_s=3600)
    name = images.save(b"png", "png")
    assert images.response(name) is not None and images.purge_expired() == 0
    images.ttl_s = -1  # everything is past its time now
    assert images.response(name) is None
    assert images.purge_expired() == 1
    assert list(outputs.listing("images/")) == []


def test_a_missing_bucket_is_a_clear_error_naming_the_flag(s3_server: S3Server, s3_credentials: None) -> None:
    with pytest.raises(OutputStoreError, match=r"^--output-url: there is no bucket 'nowhere' at http://"):
        check_output_store(s3_settings(s3_server, "nowhere"))
    check_output_store(s3_settings(s3_server, s3_server.new_bucket()))  # an existing one is fine


def test_an_unreachable_endpoint_is_a_clear_error_naming_the_flag(s3_credentials: None) -> None:
    import socket

    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{held.getsockname()[1]}"
        settings = OutputSettings.model_validate({"output_url": "s3://bucket", "s3_endpoint_url": endpoint})
        with pytest.raises(OutputStoreError, match=rf"^--s3-endpoint-url: cannot reach {endpoint}"):
            check_output_store(settings)


def test_an_output_url_must_name_a_bucket() -> None:
    for wrong in ("https://bucket/prefix", "s3://", "bucket"):
        with pytest.raises(ValueError, match="s3://BUCKET"):
            OutputSettings.model_validate({"output_url": wrong})
    assert OutputSettings.model_validate({"output_url": "s3://b/p/q/"}).output_bucket() == ("b", "p/q/")
    assert OutputSettings.model_validate({"output_url": "s3://b"}).output_bucket() == ("b", "")
