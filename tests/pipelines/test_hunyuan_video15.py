"""HunyuanVideo 1.5 specifics: image-to-video is sized by its input image's bucket (a request
asking another size is refused, naming `size`), and the guider, not the call, holds the
guidance scale that request level sets per batch."""

from __future__ import annotations

import numpy as np
import pytest

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.threads import THREADS

pytestmark = pytest.mark.slow


def test_image_to_video_takes_the_image_bucket_and_refuses_another_size() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-hunyuan-video15-i2v", num_threads=THREADS))
    wide = np.zeros((32, 64, 3), dtype=np.uint8)
    bucket = pipeline.family.size_from_image(wide)  # type: ignore[attr-defined]
    assert bucket is not None and bucket[0] > bucket[1]  # a wide image, a wide video
    request = GenerationRequest.create("x", SamplingParams(num_frames=9), input_images=(wide,))
    resolved = pipeline.resolve(request)
    assert (resolved.width, resolved.height) == bucket
    pipeline.resolve(request.with_params(SamplingParams(num_frames=9, width=bucket[0], height=bucket[1])))
    with pytest.raises(InvalidRequestError) as refused:
        pipeline.resolve(request.with_params(SamplingParams(num_frames=9, width=32, height=32)))
    assert refused.value.param == "size"


def test_request_level_sets_the_guiders_scale() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-hunyuan-video15", num_threads=THREADS))
    assert pipeline.family.call_kwargs(SamplingParams(guidance_scale=2.5)) == {}  # type: ignore[attr-defined]
    assert pipeline.pipe.guider.guidance_scale == 2.5  # type: ignore[attr-defined]
