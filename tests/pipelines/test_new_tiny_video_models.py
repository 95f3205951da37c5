"""The tiny video models of issue 24 (Wan 2.2 A14B, TI2V-5B, HunyuanVideo 1.5, Wan 2.2 VACE) load
with `DiffusionPipeline.from_pretrained` and run their stock diffusers pipeline deterministically
(tests/pipelines/test_tiny_models.py checks they build byte for byte). All are served: Wan 2.2
and HunyuanVideo 1.5 (test_stepping.py, test_families.py), VACE (test_wan_vace.py),
and these tests keep the stock pipelines' behaviour that their families rely on in view. Each
test prints its calls' wall times (`pytest -rP` shows them) and keeps them in the report's user
properties (`call_seconds`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline
from PIL import Image

from pipelines.tiny import tiny_model_dir

pytestmark = pytest.mark.slow

# 9 frames at 32x32: every family's smallest video with more than one latent frame.
SIZE = {"height": 32, "width": 32, "num_frames": 9}


def picture(seed: int, width: int = 32, height: int = 32) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def load(name: str) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(tiny_model_dir(name))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def call_times(request: pytest.FixtureRequest) -> Iterator[list[float]]:
    """Wall times of the test's pipeline calls, printed and kept in the report at the end."""
    times: list[float] = []
    yield times
    request.node.user_properties.append(("call_seconds", times))
    print(f"{request.node.name}: calls took {', '.join(f'{t:.2f}' for t in times)} s")


def timed_call(pipe: DiffusionPipeline, times: list[float], seed: int = 0, **kwargs: Any) -> np.ndarray:
    """The pipeline's frames for `kwargs` with a generator seeded `seed`; its wall time goes to `times`."""
    start = time.perf_counter()
    frames = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs).frames
    times.append(time.perf_counter() - start)
    result: np.ndarray = np.asarray(frames)
    return result


def assert_deterministic(first: np.ndarray, again: np.ndarray, other_seed: np.ndarray) -> None:
    assert first.shape == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other_seed).max() > 0.01


class ExpertCalls:
    """Counts the forwards of a pipeline's `transformer` (1) and `transformer_2` (2), in order."""

    def __init__(self, pipe: DiffusionPipeline) -> None:
        self.calls: list[int] = []
        pipe.transformer.register_forward_hook(lambda *_: self.calls.append(1))
        pipe.transformer_2.register_forward_hook(lambda *_: self.calls.append(2))


def test_wan22_switches_to_the_low_noise_expert_at_the_boundary(call_times: list[float]) -> None:
    pipe = load("tiny-wan22")
    # Shift 12 keeps the first three of four timesteps (999, 973, 923, 800) above the boundary, 875.
    pipe.scheduler.set_timesteps(4)
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    assert [bool(t >= boundary) for t in pipe.scheduler.timesteps] == [True, True, True, False]
    experts = ExpertCalls(pipe)
    kwargs: dict[str, Any] = {
        "prompt": "a cat",
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
        "guidance_scale_2": 3.0,
        **SIZE,
    }
    first = timed_call(pipe, call_times, **kwargs)
    # Guidance above 1: a conditional and an unconditional forward per step, by the step's expert.
    assert experts.calls == [1, 1, 1, 1, 1, 1, 2, 2]
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))
    # guidance_scale_2 reaches the low-noise steps only.
    other_low = timed_call(pipe, call_times, **{**kwargs, "guidance_scale_2": 1.5})
    assert np.abs(first - other_low).max() > 0


def test_wan22_image_to_video_runs_both_experts_in_two_steps(call_times: list[float]) -> None:
    pipe = load("tiny-wan22-i2v")
    experts = ExpertCalls(pipe)
    # Shift 5: timesteps 999 and 833 fall either side of the boundary, 900.
    kwargs: dict[str, Any] = {"prompt": "a cat", "image": picture(0), "num_inference_steps": 2, **SIZE}
    first = timed_call(pipe, call_times, **kwargs)
    assert experts.calls == [1, 1, 2, 2]
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))


def test_wan22_ti2v_does_text_and_image_to_video_with_per_token_timesteps(call_times: list[float]) -> None:
    pipe = load("tiny-wan22-ti2v")
    timesteps: list[torch.Tensor] = []
    pipe.transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: timesteps.append(kwargs["timestep"]), with_kwargs=True
    )
    kwargs: dict[str, Any] = {"prompt": "a cat", "num_inference_steps": 2, **SIZE}
    first = timed_call(pipe, call_times, **kwargs)
    # One timestep per token: 3 latent frames of 2x2 latents in 2x2 patches, all the step's.
    assert timesteps[0].shape == (1, 3)
    assert bool((timesteps[0] == timesteps[0][0, 0]).all())
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))

    # The same weights do image-to-video: the first latent frame is the image's, at timestep 0.
    image_to_video = WanImageToVideoPipeline.from_pipe(pipe)
    image_to_video.set_progress_bar_config(disable=True)
    timesteps.clear()
    video = timed_call(image_to_video, call_times, image=picture(0), **kwargs)
    assert timesteps[0][0, 0] == 0 and bool((timesteps[0][0, 1:] > 0).all())
    other_image = timed_call(image_to_video, call_times, image=picture(1), **kwargs)
    assert np.abs(video - other_image).max() > 0.01


def test_hunyuan_video15_reads_its_prompt_and_glyphs(call_times: list[float]) -> None:
    pipe = load("tiny-hunyuan-video15")
    # Quoted text also goes through ByT5 (the glyph encoder).
    kwargs: dict[str, Any] = {
        "prompt": 'a cat holding a sign that says "hello"',
        "num_inference_steps": 2,
        **SIZE,
    }
    first = timed_call(pipe, call_times, **kwargs)
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))
    other_glyphs = timed_call(
        pipe, call_times, **{**kwargs, "prompt": kwargs["prompt"].replace("hello", "bye")}
    )
    assert np.abs(first - other_glyphs).max() > 0


def test_hunyuan_video15_image_to_video_takes_its_size_from_the_image(call_times: list[float]) -> None:
    pipe = load("tiny-hunyuan-video15-i2v")
    # No height/width arguments: the image's aspect ratio, bucketed to target_size 32, gives 32x32.
    kwargs: dict[str, Any] = {
        "prompt": "a cat",
        "image": picture(0),
        "num_frames": 9,
        "num_inference_steps": 2,
    }
    first = timed_call(pipe, call_times, **kwargs)
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))


def test_wan_vace_follows_its_control_video_mask_and_reference(call_times: list[float]) -> None:
    pipe = load("tiny-wan-vace")
    experts = ExpertCalls(pipe)
    # Keep the first frame (black mask), redraw the rest (white); one reference image in front.
    frames = [picture(seed) for seed in range(SIZE["num_frames"])]
    mask = [Image.new("L", (32, 32), 0)] + [Image.new("L", (32, 32), 255)] * (SIZE["num_frames"] - 1)
    kwargs: dict[str, Any] = {
        "prompt": "a cat",
        "video": frames,
        "mask": mask,
        "reference_images": [picture(100, width=40, height=24)],
        "num_inference_steps": 4,
        **SIZE,
    }
    first = timed_call(pipe, call_times, **kwargs)
    assert experts.calls == [1, 1, 1, 1, 1, 1, 2, 2]  # Wan 2.2 T2V's boundary and shift.
    again = timed_call(pipe, call_times, **kwargs)
    assert_deterministic(first, again, timed_call(pipe, call_times, seed=1, **kwargs))
    no_control = timed_call(pipe, call_times, **{**kwargs, "conditioning_scale": 0.0})
    assert np.abs(first - no_control).max() > 0.01
