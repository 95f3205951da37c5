"""`python -m bench.decode_overlap`'s driver, over a fake stepping pipeline: every request
of the stream is served, whichever way it decodes."""

from __future__ import annotations

import pytest

from bench.decode_overlap import images_per_second
from engine.worker.decoding import DECODE_OVERLAP_CHOICES, DecodeOverlap
from tests.engine.fakes import FakeStepPipeline


@pytest.mark.parametrize("mode", DECODE_OVERLAP_CHOICES)
def test_the_stream_is_served_in_every_mode(mode: DecodeOverlap) -> None:
    pipeline = FakeStepPipeline()
    assert images_per_second(pipeline, mode, steps=4, group=8, total=24) > 0
    assert sum(len(ids) for ids in pipeline.finished) == 24
