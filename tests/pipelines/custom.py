"""Custom pipeline classes loaded by `module:Class`, as a user's own would be."""

from __future__ import annotations

from typing import ClassVar

from engine.request import RequestBatch, RequestOutput
from pipelines.text_to_image import DiffusersTextToImage


class MarkedFailurePipeline(DiffusersTextToImage):
    """The real tiny pipeline, except that a forward holding a prompt with FAIL raises."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if any("FAIL" in request.prompt for request in batch.requests):
            raise RuntimeError("this request is marked to fail")
        return super().forward(batch)


class SerialTextToImage(DiffusersTextToImage):
    """The real tiny pipeline, declared unable to batch requests."""

    supports_request_batch: ClassVar[bool] = False
