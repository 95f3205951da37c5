"""`--quality` without a model: the held-out requests, judging pictures against captions and
a reference, the table and the JSON, with contenders that hand back made-up pictures."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.cli import build_parser
from bench.contenders import Load, Pictures, RoundResult, _fields, _first_partial_image
from bench.quality_pass import REFERENCE, held_out_specs, judge, measure_quality, quality_json, quality_table
from bench.workload import RequestSpec
from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS

COUNT = len(HELD_OUT_PROMPTS)


def pictures(seed: int, failed: tuple[int, ...] = ()) -> Pictures:
    rng = np.random.default_rng(seed)
    images: list[np.ndarray | None] = [
        rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(COUNT)
    ]
    for i in failed:
        images[i] = None
    return Pictures(images, "HTTP 500: boom" if failed else None)


class Drawing:
    """A contender that draws the same made-up pictures whatever it is asked."""

    def __init__(self, name: str, drawn: Pictures, draws_previews: bool = True) -> None:
        self.name, self.drawn, self.draws_previews = name, drawn, draws_previews
        self.asked: list[list[RequestSpec]] = []

    async def run(self, load: Load, specs: list[RequestSpec]) -> RoundResult:
        raise AssertionError("--quality does not time anything")

    async def pictures(self, specs: list[RequestSpec], concurrency: int) -> Pictures:
        self.asked.append(specs)
        return self.drawn


def test_the_held_out_requests_are_the_fixed_prompts_and_seeds_at_64() -> None:
    specs = held_out_specs(None)
    assert [s.prompt for s in specs] == list(HELD_OUT_PROMPTS)
    assert [s.seed for s in specs] == list(range(1000, 1000 + COUNT)) == list(HELD_OUT_SEEDS)
    assert {(s.width, s.height, s.steps, s.n, s.guidance) for s in specs} == {(64, 64, None, 1, None)}
    assert {s.steps for s in held_out_specs(8)} == {8}
    # No steps: the request leaves them to the server's default.
    assert "num_inference_steps" not in _fields(specs[0])
    assert _fields(held_out_specs(8)[0])["num_inference_steps"] == 8


def test_a_contender_is_judged_against_its_captions_and_the_reference() -> None:
    reference = pictures(0)
    same = judge("same", reference, reference)
    assert same.psnr_db == math.inf and same.ssim == pytest.approx(1.0)
    assert same.compared == COUNT and same.failed == 0
    other = judge("other", pictures(1, failed=(3, 5)), reference)
    assert other.compared == COUNT - 2 and other.failed == 2 and other.error == "HTTP 500: boom"
    assert other.psnr_db is not None and other.psnr_db < 10 and other.ssim is not None and other.ssim < 0.1
    # A failed picture is scored as nothing drawn: every attribute it asks for is a miss.
    assert other.accuracy.totals == same.accuracy.totals
    assert other.accuracy.totals["background"] == COUNT
    alone = judge("alone", pictures(1), None)
    assert alone.psnr_db is None and alone.ssim is None and alone.compared == 0


def test_with_previews_each_server_draws_the_set_twice_and_is_judged_on_its_middle_step_previews(
    tmp_path: Path,
) -> None:
    reference, server = Drawing(REFERENCE, pictures(0)), Drawing("linear", pictures(1))
    direct = Drawing("direct", pictures(2), draws_previews=False)
    results = asyncio.run(
        measure_quality(
            [direct, server],
            reference,
            steps=None,
            reference_steps=20,
            concurrency=8,
            out=tmp_path,
            previews=True,
        )
    )
    assert [r.contender for r in results] == [REFERENCE, "linear"] and direct.asked == []
    assert {s.partial_images for s in reference.asked[0]} == {0}  # the reference: final pictures
    assert len(server.asked) == 2  # once for the preview decoder to fit, once scored
    assert all({s.partial_images for s in asked} == {1} for asked in server.asked)


def test_the_first_partial_image_of_a_stream_is_the_picture() -> None:
    events = [
        {"type": "image_generation.partial_image", "b64_json": "first", "partial_image_index": 0},
        {"type": "image_generation.completed", "b64_json": "final"},
    ]
    stream = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    assert _first_partial_image(": keep-alive\n\n" + stream) == "first"
    assert _first_partial_image(stream.split("event: image_generation.completed")[1]) is None


def test_measure_quality_draws_the_reference_first_and_saves_grids(tmp_path: Path) -> None:
    reference = Drawing(REFERENCE, pictures(0))
    fast = Drawing("fast", pictures(1))
    results = asyncio.run(
        measure_quality([fast], reference, steps=4, reference_steps=20, concurrency=8, out=tmp_path)
    )
    assert [r.contender for r in results] == [REFERENCE, "fast"]
    assert {s.steps for s in reference.asked[0]} == {20} and {s.steps for s in fast.asked[0]} == {4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quality-fast.png", "quality-reference.png"]
    speed: dict[str, dict[str, float | None]] = {"fast": {"outputs_per_s": 12.5, "p50_s": 0.25}}
    table = quality_table(results, speed)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert set(rows) == {REFERENCE, "fast"}
    assert "| 12.50 | 250 |" in rows["fast"] and "| - | - |" in rows[REFERENCE]
    assert rows[REFERENCE].count("ref") == 3  # the name, then PSNR and SSIM
    assert "%" in rows["fast"]
    document = json.loads(json.dumps(quality_json(results), allow_nan=False))
    assert document[REFERENCE]["psnr_db"] == "inf" and document["fast"]["compared"] == COUNT
    assert document["fast"]["totals"]["background"] == COUNT


def test_the_quality_flags_parse() -> None:
    args = build_parser().parse_args(["--quality", "--quality-steps", "8", "--reference-steps", "32"])
    assert args.quality and args.quality_steps == 8 and args.reference_steps == 32
    assert not build_parser().parse_args([]).quality
