"""The request types reject what cannot be served, with messages that say what to do."""

from __future__ import annotations

import math

import pytest

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams


@pytest.mark.parametrize("prompt", [["a cat", "a dog"], ("a cat",), 42, None])
def test_only_one_string_prompt_is_accepted(prompt: object) -> None:
    with pytest.raises(InvalidRequestError, match="one request per prompt") as error:
        GenerationRequest(request_id="r", prompt=prompt)  # type: ignore[arg-type]
    assert error.value.param == "prompt"


def test_list_prompt_message_names_the_list() -> None:
    with pytest.raises(InvalidRequestError, match="got a list of prompts"):
        GenerationRequest.create(["a", "b"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("width", -64),
        ("num_inference_steps", 0),
        ("guidance_scale", math.nan),
        ("seed", -1),
        ("seed", 2**63),
        ("negative_prompt", ["x"]),
        ("output_type", "pil"),
        ("quality", "hd"),  # the server maps OpenAI's names onto low, medium, high
    ],
)
def test_bad_sampling_params_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert error.value.param == field


def test_created_requests_have_unique_ids_and_deadlines() -> None:
    a = GenerationRequest.create("a cat", timeout_s=5)
    b = GenerationRequest.create("a cat")
    assert a.request_id != b.request_id
    assert a.deadline is not None and a.deadline > a.arrival_time
    assert b.deadline is None


def test_image_seeds_need_a_resolved_seed() -> None:
    assert SamplingParams(seed=5, n=3).image_seeds() == [5, 6, 7]
    with pytest.raises(RuntimeError):
        SamplingParams().image_seeds()
