"""Custom pipeline classes loaded by `module:Class`, as a user's own would be."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import ClassVar

from engine.request import ForwardInterrupted, RequestBatch, RequestOutput
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


class GatedTextToImage(MarkedFailurePipeline):
    """The real tiny pipeline, except that a forward holding a prompt with HOLD waits until
    the file named by DIFFBATCH_TEST_GATE exists: end-to-end tests keep the engine busy for
    as long as they need, whatever the speed of the machine. While it waits it honours the
    engine's interrupt, as a denoising loop does between steps."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if any("HOLD" in request.prompt for request in batch.requests):
            gate = Path(os.environ["DIFFBATCH_TEST_GATE"])
            deadline = time.monotonic() + 600
            while not gate.exists() and time.monotonic() < deadline:
                if self.interrupt is not None and self.interrupt.is_set():
                    raise ForwardInterrupted
                time.sleep(0.01)
        return super().forward(batch)
