"""Sequence parallelism on the real tiny FLUX (`pipelines.parallel.sequence`): the processes of
a lane (gloo on the CPU) each step the same mixed group — a guided request with its own true
CFG scale and a negative prompt, one without guidance, one joining mid-run — with diffusers'
Ulysses attention splitting every forward's tokens between them, and every request's images
equal its one-device images within 1/255 (CPU float32). With `--cfg-parallel 2` as well, four
processes: two CFG shares of two token shares each. The step matrix of
tests/pipelines/test_stepping.py holds the one-device images to diffusers' own pipeline."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.request import GenerationRequest
from pipelines.base import PipelineConfig
from pipelines.parallel.seat import LaneShape
from server.composition import load_configured
from tests.pipelines.engines import difference
from tests.pipelines.test_cfg_parallel import JOINS, mixed_group, run_lane
from tests.pipelines.test_stepping import loaded, run_interleaved

pytestmark = pytest.mark.slow

MODEL = "tiny-flux"


def watch_tokens(pipeline: Any) -> tuple[dict[str, int], Any]:
    """Counts of the image and text tokens the first transformer block is given, over every
    forward: inside the context-parallel hooks, so a device's share where tokens are split."""
    seen = {"rows": 0, "image": 0, "text": 0}

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen["rows"] += kwargs["hidden_states"].shape[0]
        seen["image"] += kwargs["hidden_states"].shape[0] * kwargs["hidden_states"].shape[1]
        seen["text"] += kwargs["encoder_hidden_states"].shape[0] * kwargs["encoder_hidden_states"].shape[1]

    block = pipeline.family.pipe.transformer.transformer_blocks[0]
    return seen, block.register_forward_pre_hook(count, with_kwargs=True)


def token_member(config: PipelineConfig, requests: list[GenerationRequest], answers: Any) -> None:
    """One member of the lane: load, join, step the group, send (its outputs, tokens seen)."""
    pipeline: Any = load_configured(config)
    seen, _ = watch_tokens(pipeline)
    outputs = run_interleaved(pipeline, requests, JOINS)
    answers.put((config.lane.rank if config.lane else -1, outputs, seen))


@pytest.mark.parametrize(
    "shape", [LaneShape(sequence=2), LaneShape(cfg=2, sequence=2)], ids=["ulysses2", "cfg2-ulysses2"]
)
def test_each_request_under_sequence_parallel_equals_its_one_device_image(shape: LaneShape) -> None:
    pipeline = loaded(MODEL)
    requests = mixed_group(pipeline)
    assert [pipeline.family.uses_cfg(r) for r in requests] == [True, False, True]
    whole, hook = watch_tokens(pipeline)
    try:
        alone = run_interleaved(pipeline, requests, JOINS)
    finally:
        hook.remove()
    got = run_lane(replace(pipeline.config, num_threads=1), requests, shape, token_member)
    # Each member was given its share of every forward's tokens: together, the rows each
    # CFG share ran times every token once.
    rows = [got[rank][1]["rows"] for rank in range(shape.size)]
    assert sum(rows[:: shape.sequence]) == whole["rows"]
    for rank in range(shape.size):
        _, seen = got[rank]
        assert seen["rows"] > 0
        for part in ("image", "text"):  # seen = whole x (its share of the rows) / sequence
            assert seen[part] * shape.sequence * whole["rows"] == whole[part] * rows[rank], part
    # Only the lead decodes.
    assert all(output.images == () for rank in range(1, shape.size) for output in got[rank][0].values())
    lead = got[0][0]
    for request in requests:
        output, expected = lead[request.request_id], alone[request.request_id]
        assert output.seeds == expected.seeds
        for image, reference in zip(output.images, expected.images, strict=True):
            assert difference(image, reference) <= 1, request.params
