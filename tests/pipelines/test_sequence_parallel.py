"""Sequence parallelism on the real tiny models (`pipelines.parallel.sequence`): the processes of
a lane (gloo on the CPU) each step the same mixed group — a guided request with its own CFG
scale (and a negative prompt where the family takes one), one without guidance, one joining
mid-run — with diffusers' Ulysses attention splitting every forward's tokens between them,
and every request's images (videos) equal its one-device images within 1/255 (CPU float32).
Each family that `splits_tokens`: FLUX.1, FLUX.2 (klein: its true CFG; dev shares the
transformer and the forward), Qwen-Image (prompts of different lengths: its text padded to
a multiple of N), Wan 2.2 A14B (both experts split; Wan 2.1's transformer is the same class)
and LTX (its text mask per head). With `--cfg-parallel 2` as well, four processes for
FLUX.1: two CFG shares of two token shares each. Ring 2 as well (its partial attentions'
log-sum-exp from `pipelines.parallel.ring_cpu`) for the families whose plan cuts no
attention mask: FLUX.1 (and 2 x 2 with `--cfg-parallel`), FLUX.2 klein, Wan 2.2 A14B. The
step matrix of tests/pipelines/test_stepping.py holds the one-device images to diffusers'
own pipeline.

The two-member lanes of every family and mode run in one pair of processes, the four-member
ones in one set of four, one lane after another (each joins and leaves its own process
group), so they share the processes' start. FLUX.1's lanes then step a group under
the step caches in the same processes: each request decides over all its tokens, whichever
device holds them, and its images and skips are its one-device ones."""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.parallel.lane_group import GROUP_TIMEOUT_S
from pipelines.parallel.lane_split import BROKEN_LANE_EXIT
from pipelines.parallel.seat import LaneShape, lane_seats
from server.composition import load_configured
from tests.pipelines.engines import difference
from tests.pipelines.test_cfg_parallel import JOINS, groups_of, mixed_group, one_device, run_counted, spawned
from tests.pipelines.test_stepping import loaded, run_interleaved

pytestmark = pytest.mark.slow

ULYSSES2, CFG2_ULYSSES2 = LaneShape(sequence=2), LaneShape(cfg=2, sequence=2)
RING2, CFG2_RING2 = LaneShape(sequence=2, mode="ring"), LaneShape(cfg=2, sequence=2, mode="ring")
CASES = [
    ("tiny-flux", ULYSSES2),
    ("tiny-flux", CFG2_ULYSSES2),
    ("tiny-flux2-klein", ULYSSES2),
    ("tiny-qwen-image", ULYSSES2),
    ("tiny-wan22", ULYSSES2),
    ("tiny-ltx", ULYSSES2),
    # Ring on the CPU (`pipelines.parallel.ring_cpu`), where the plan cuts no attention mask
    # (Qwen-Image's and LTX's are refused: tests/server/test_cfg_parallel_settings.py).
    ("tiny-flux", RING2),
    ("tiny-flux", CFG2_RING2),
    ("tiny-flux2-klein", RING2),
    ("tiny-wan22", RING2),
]
_NAMES = {ULYSSES2: "ulysses2", CFG2_ULYSSES2: "cfg2-ulysses2", RING2: "ring2", CFG2_RING2: "cfg2-ring2"}


def watch_tokens(pipeline: Any) -> tuple[dict[str, int], list[Any]]:
    """Counts of the image (video) and text tokens each denoiser's first block's attention is
    given, over every forward: inside the context-parallel hooks (the plan cuts Qwen-Image's
    and Wan's at the block's own entry), so a device's share where tokens are split. The
    image's from the block's first attention (joint, or self-attention), the text's from the
    one that takes it (joint, or cross-attention)."""
    seen = {"rows": 0, "image": 0, "text": 0}

    def count(*parts: str) -> Any:
        def counted(attention: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            given = inspect.signature(attention.forward).bind_partial(*args, **kwargs).arguments
            for part, name in (("image", "hidden_states"), ("text", "encoder_hidden_states")):
                if part in parts:
                    tokens = given[name]
                    seen[part] += tokens.shape[0] * tokens.shape[1]
            seen["rows"] += given["hidden_states"].shape[0] if "image" in parts else 0

        return counted

    hooks = []
    pipe = pipeline.family.pipe  # each transformer, whether the lane split it or not
    for denoiser in (d for d in (pipe.transformer, getattr(pipe, "transformer_2", None)) if d is not None):
        block = (getattr(denoiser, "transformer_blocks", None) or denoiser.blocks)[0]
        joint = getattr(block, "attn", None)
        if joint is not None:
            hooks.append(joint.register_forward_pre_hook(count("image", "text"), with_kwargs=True))
        else:
            hooks.append(block.attn1.register_forward_pre_hook(count("image"), with_kwargs=True))
            hooks.append(block.attn2.register_forward_pre_hook(count("text"), with_kwargs=True))
    return seen, hooks


def split_parts(pipeline: Any) -> list[str]:
    """The parts whose tokens the plan cuts and the family counts (`sequence_lengths`): the
    image (a video's too); the text where its length is fixed."""
    parts = pipeline.family.sequence_lengths(SamplingParams(width=32, height=32, num_frames=9))
    return ["image"] + (["text"] if "text" in parts else [])


def token_member(jobs: list[tuple[PipelineConfig, list[tuple[Any, ...]]]], answers: Any) -> None:
    """One member of a lane, for each job in turn: load and join its lane, step each of its
    groups (requests, joins), send (its model, lane shape, rank, and for each group its
    outputs, tokens seen and requests' skips), leave the group."""
    for config, groups in jobs:
        pipeline: Any = load_configured(config)
        seen, _ = watch_tokens(pipeline)
        ran = []
        for requests, joins in groups:
            outputs, _, skips = run_counted(pipeline, requests, joins)
            ran.append((outputs, dict(seen), skips))
            seen.update(rows=0, image=0, text=0)
        assert config.lane is not None
        answers.put((config.model, config.lane.shape, config.lane.rank, ran))
        torch.distributed.destroy_process_group()


def cached(model: str) -> list[tuple[Any, ...]]:
    """The groups under the step caches a model's lanes step after its mixed group."""
    return groups_of(model)[1:] if model == "tiny-flux" else []


@functools.cache
def alone(model: str) -> tuple[list[GenerationRequest], dict[str, Any], dict[str, int]]:
    """The model's group, its images on one device and the tokens the whole forwards had."""
    pipeline = loaded(model)
    requests = mixed_group(pipeline)
    assert [pipeline.family.uses_cfg(r) for r in requests] == [True, False, True]
    whole, hooks = watch_tokens(pipeline)
    try:
        outputs = run_interleaved(pipeline, requests, JOINS)
    finally:
        for hook in hooks:
            hook.remove()
    return requests, outputs, whole


@functools.cache
def lanes(size: int) -> dict[tuple[str, LaneShape], dict[int, tuple[Any, ...]]]:
    """Each case of a lane of `size` members in its lane, all in one set of `size` processes
    (Ulysses' and ring's one after another): (model, shape) -> rank -> for each group (the
    mixed one, then `cached`'s) (outputs, tokens seen, requests' skips)."""
    cases = [(model, shape) for model, shape in CASES if shape.size == size]
    # Each job its own seats (its own address: a group of its own).
    seats = [lane_seats(shape) for _, shape in cases]
    jobs = [
        (
            [
                (
                    replace(loaded(m).config, num_threads=1, lane=seats[i][rank]),
                    [(alone(m)[0], JOINS), *cached(m)],
                )
                for i, (m, shape) in enumerate(cases)
            ],
        )
        for rank in range(size)
    ]
    got: dict[tuple[str, LaneShape], dict[int, Any]] = {}
    for model, shape, rank, ran in spawned(token_member, jobs, size * len(cases)):
        got.setdefault((model, shape), {})[rank] = ran
    return got


@pytest.mark.parametrize(("model", "shape"), CASES, ids=[f"{m}-{_NAMES[s]}" for m, s in CASES])
def test_each_request_under_sequence_parallel_equals_its_one_device_image(
    model: str, shape: LaneShape
) -> None:
    requests, expected_outputs, whole = alone(model)
    got = {rank: ran[0][:2] for rank, ran in lanes(shape.size)[model, shape].items()}
    # Each member was given its share of every forward's tokens: together, the rows each
    # CFG share ran times every token once.
    rows = [got[rank][1]["rows"] for rank in range(shape.size)]
    assert sum(rows[:: shape.sequence]) == whole["rows"]
    for rank in range(shape.size):
        _, seen = got[rank]
        assert seen["rows"] > 0
        for part in split_parts(loaded(model)):  # seen = whole x (its share of the rows) / sequence
            assert seen[part] * shape.sequence * whole["rows"] == whole[part] * rows[rank], part
    # Only the lead decodes.
    assert all(output.images == () for rank in range(1, shape.size) for output in got[rank][0].values())
    lead = got[0][0]
    for request in requests:
        output, expected = lead[request.request_id], expected_outputs[request.request_id]
        assert output.seeds == expected.seeds
        for image, reference in zip(output.images, expected.images, strict=True):
            assert difference(image, reference) <= 1, request.params


@pytest.mark.parametrize("shape", [ULYSSES2, CFG2_ULYSSES2, RING2, CFG2_RING2], ids=_NAMES.get)
def test_each_cached_request_under_sequence_parallel_skips_and_draws_as_on_one_device(
    shape: LaneShape,
) -> None:
    """First-Block Cache and TaylorSeer with FLUX.1's tokens split (and its guided rows, with
    CFG-parallel too): each device saw its share of every row's tokens, each request's skips
    are its one-device ones on each device that holds its rows (its decision sums every
    device's share), and so are its images."""
    ((requests, _),) = cached("tiny-flux")
    alone_outputs, _, skips_alone = one_device("tiny-flux")[1]
    got = lanes(shape.size)["tiny-flux", shape]
    tokens = loaded("tiny-flux").family.sequence_lengths(requests[0].params)["image"]
    family = loaded("tiny-flux").family
    assert any(0 < skipped[0] < 7 for skipped in skips_alone.values() if skipped[0] is not None)
    for rank in range(shape.size):
        _, seen, skips = got[rank][1]
        assert seen["rows"] > 0 and seen["image"] * shape.sequence == seen["rows"] * tokens
        for request in requests:
            rid = request.request_id
            # Without a CFG split every device holds every row; with it, the share 1 devices
            # hold the guided requests' negative rows (and every TaylorSeer series).
            if rank < shape.sequence or family.uses_cfg(request) or skips_alone[rid][1] is not None:
                assert skips[rid] == skips_alone[rid], (rank, request.params)
    lead = got[0][1][0]
    for request in requests:
        for image, reference in zip(
            lead[request.request_id].images, alone_outputs[request.request_id].images, strict=True
        ):
            assert difference(image, reference) <= 1, request.params


@pytest.mark.parametrize(
    ("model", "refused"),
    [
        ("tiny-flux", False),
        ("tiny-flux2-klein", False),
        ("tiny-ltx", False),
        ("tiny-qwen-image", True),
        ("tiny-wan22", True),
    ],
)
def test_first_block_cache_with_split_tokens_is_refused_where_the_plan_cuts_at_the_first_block(
    model: str, refused: bool
) -> None:
    """Qwen-Image's and Wan's plans cut the tokens at their first block's entry, inside the
    cache's probe of that block; TaylorSeer predicts whole outputs and goes everywhere."""
    pipeline = loaded(model)
    config = pipeline.config
    pipeline.config = replace(config, lane=lane_seats(ULYSSES2)[0])
    try:
        said = pipeline.cache_refusal("first-block")
        assert pipeline.cache_refusal("taylorseer") is None
    finally:
        pipeline.config = config
    assert (said is not None) == refused, said
    assert said is None or said.endswith(
        "plan cuts its tokens at its first block's entry, where First-Block Cache measures that "
        "block's change; --sequence-parallel splits its tokens"
    )


@pytest.mark.parametrize(
    ("model", "size", "frames", "param", "said"),
    [
        ("tiny-wan22", 48, 9, "size", "size 48x48 at 9 frames gives 27 video tokens"),
        ("tiny-wan22", 48, 5, None, None),  # 2 latent frames of 9 tokens
        ("tiny-flux2-klein", 36, None, "size", "size 36x36 gives 81 image tokens"),  # 4 px a token
        ("tiny-flux2-klein", 32, None, "image", "the input images add 289 image tokens to the 64"),
    ],
)
def test_tokens_that_do_not_split_in_equal_parts_are_a_400_naming_the_field(
    model: str, size: int, frames: int | None, param: str | None, said: str | None
) -> None:
    pipeline = loaded(model)
    family, config = pipeline.family, pipeline.family.config
    family.config = replace(config, lane=lane_seats(ULYSSES2)[0])
    # FLUX.2's reference: 68x68 pixels, 17x17 tokens, after the request's own 8x8.
    images = (np.zeros((68, 68, 3), dtype=np.uint8),) if param == "image" else ()
    params = SamplingParams(width=size, height=size, num_frames=frames)
    try:
        request = GenerationRequest.create("a red cat", params, input_images=images)
        if said is None:
            pipeline.validate(pipeline.resolve(request))
            return
        with pytest.raises(InvalidRequestError, match=re.escape(said)) as raised:
            pipeline.validate(pipeline.resolve(request))
        assert raised.value.param == param
    finally:
        family.config = config


def failing_member(config: PipelineConfig) -> None:
    """A member of a lane whose forward raises on member 1 only, inside the denoiser (at its
    first single-stream block, after the joint blocks' token exchanges): member 0 is then
    inside that block's exchange, waiting for member 1."""
    pipeline: Any = load_configured(config)
    assert config.lane is not None
    if config.lane.rank == 1:

        def fail(*_: Any) -> None:
            raise RuntimeError("an injected failure on member 1")

        pipeline.family.pipe.transformer.single_transformer_blocks[0].register_forward_pre_hook(fail)
    run_interleaved(pipeline, mixed_group(pipeline)[:1], [0])


def test_a_forward_that_raises_on_one_member_ends_the_lane_before_its_timeout() -> None:
    """Both members end as a broken lane (their supervisors would restart the group): the
    one that raised at once, the other when its exchange loses its peer, long before the
    group's timeout would have released it."""
    config = replace(loaded("tiny-flux").config, num_threads=1)
    context = multiprocessing.get_context("spawn")
    members = [
        context.Process(target=failing_member, args=(replace(config, lane=seat),), daemon=True)
        for seat in lane_seats(ULYSSES2)
    ]
    for process in members:
        process.start()
    try:
        for process in members:  # a hang guard, below the timeout this test rules out
            process.join(timeout=GROUP_TIMEOUT_S * 0.8)
        assert [process.exitcode for process in members] == [BROKEN_LANE_EXIT] * 2
    finally:
        for process in members:
            if process.is_alive():
                process.kill()


def compiled_member(config: PipelineConfig, requests: list[GenerationRequest], answers: Any) -> None:
    """A member of a lane with a compiled denoiser: load (it warms up once joined), step the
    requests, send (its rank, the graphs compiled by the warm-up, those compiled after it,
    its outputs)."""
    from torch._dynamo.utils import counters

    pipeline: Any = load_configured(config)
    warmed = counters["stats"]["unique_graphs"]
    outputs = run_interleaved(pipeline, requests, JOINS)
    assert config.lane is not None
    answers.put((config.lane.rank, warmed, counters["stats"]["unique_graphs"] - warmed, outputs))
    torch.distributed.destroy_process_group()


def test_a_compiled_lane_warms_up_with_its_tokens_split_and_never_compiles_in_a_request() -> None:
    """`--compile blocks` with Ulysses 2: the exchanges sit inside the compiled blocks'
    attention, so each member warms up once the lane is joined (the same dummy requests on
    both); the mixed group at the warmed size then compiles nothing, and its images are its
    one-device, uncompiled ones."""
    pipeline = loaded("tiny-flux")
    requests = [r.with_params(replace(r.params, width=64, height=64)) for r in mixed_group(pipeline)]
    expected = run_interleaved(pipeline, requests, JOINS)
    config = replace(
        pipeline.config, num_threads=1, denoiser=replace(pipeline.config.denoiser, compile="blocks")
    )
    seats = lane_seats(ULYSSES2)
    answers = spawned(compiled_member, [(replace(config, lane=seat), requests) for seat in seats], len(seats))
    for rank, warmed, compiled_after, outputs in answers:
        assert warmed > 0 and compiled_after == 0, rank
        if rank == 0:
            for request in requests:
                for image, reference in zip(
                    outputs[request.request_id].images, expected[request.request_id].images, strict=True
                ):
                    assert difference(image, reference) <= 1, request.params
