"""LoRA adapters at the HTTP edge: `/v1/models` lists them under their base, a request picks
one with `model` or `lora` (with a scale), and names nobody serves are 404 error objects."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from pydantic import ValidationError

from engine.request import InvalidRequestError, LoraRef, RequestBatch, RequestOutput
from server.protocol import ImageEditRequest, LoraChoice
from server.settings import SettingsError, load_settings
from tests.media import png
from tests.server.conftest import ClientFactory, ImageFakePipeline
from tests.server.test_images_api import URL, assert_error

ADAPTERS = {"ghibli": "tiny-lora-1", "pixel": "tiny-lora-2"}


# What `pipelines/lora.py` raises for an adapter whose files do not fit the model: a message
# for the operator, with the adapter's source and the loader's exception.
BROKEN_PROBLEM = (
    "the LoRA adapter 'broken' (/srv/models/customer-x) cannot be loaded into tiny-sd: "
    "NoMatchingPeftModuleError: no module of the model matched 'lora_unet_down_0'"
)


class RecordingPipeline(ImageFakePipeline):
    """Keeps the LoRA each request reached the pipeline with; the adapter "broken" fails to
    load, as a LoRA of another model does."""

    def __init__(self) -> None:
        super().__init__()
        self.loras: list[LoraRef | None] = []

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        lora = batch.requests[0].params.lora
        if lora is not None and lora.name == "broken":
            raise InvalidRequestError(BROKEN_PROBLEM, "model")
        self.loras.extend(request.params.lora for request in batch.requests)
        return super().forward(batch)


@pytest.fixture
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


async def test_models_lists_each_adapter_with_its_base_as_parent(make_client: ClientFactory) -> None:
    client = await make_client(lora_modules=ADAPTERS)
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("test-model", None, "test-model"),
        ("ghibli", "test-model", "test-model"),
        ("pixel", "test-model", "test-model"),
    ]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"model": "test-model"}, None),
        ({"model": "ghibli"}, LoraRef("ghibli", 1.0)),
        ({"lora": "pixel"}, LoraRef("pixel", 1.0)),
        ({"lora": {"name": "pixel", "scale": 0.6}}, LoraRef("pixel", 0.6)),
        ({"model": "ghibli", "lora": {"name": "ghibli", "scale": -0.5}}, LoraRef("ghibli", -0.5)),
    ],
)
async def test_a_request_reaches_the_pipeline_with_the_adapter_it_chose(
    make_client: ClientFactory, pipeline: RecordingPipeline, fields: dict[str, Any], expected: LoraRef | None
) -> None:
    client = await make_client(lora_modules=ADAPTERS)
    response = await client.post(URL, json={"prompt": "a harbour", **fields})
    assert response.status_code == 200, response.text
    assert pipeline.loras == [expected]


async def test_names_nobody_serves_are_404_and_conflicts_400(make_client: ClientFactory) -> None:
    client = await make_client(lora_modules=ADAPTERS)
    assert_error(
        await client.post(URL, json={"prompt": "a", "model": "anime"}), 404, "model", "model_not_found"
    )
    assert_error(
        await client.post(URL, json={"prompt": "a", "lora": "anime"}), 404, "lora", "model_not_found"
    )
    conflict = {"prompt": "a", "model": "ghibli", "lora": "pixel"}
    assert_error(await client.post(URL, json=conflict), 400, "lora")
    too_strong = {"prompt": "a", "lora": {"name": "pixel", "scale": 5}}
    assert_error(await client.post(URL, json=too_strong), 400, "lora.scale")


async def test_without_adapters_a_lora_is_404(make_client: ClientFactory) -> None:
    client = await make_client()
    assert_error(
        await client.post(URL, json={"prompt": "a", "lora": "pixel"}), 404, "lora", "model_not_found"
    )


@pytest.mark.parametrize(
    "value",
    [["ghibli=tiny-lora-1", "pixel=tiny-lora-2"], "ghibli=tiny-lora-1,pixel=tiny-lora-2", ADAPTERS],
)
def test_adapters_are_read_from_flags_variables_and_presets(value: object) -> None:
    assert load_settings(overrides={"lora_modules": value}).lora_modules == ADAPTERS


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["ghibli"], "NAME=SOURCE"),
        (["a=x", "a=y"], "once"),
        (["has space=x"], "letters, digits"),
        ({"../up": "x"}, "letters, digits"),
        (["tiny-sd=tiny-lora-1"], "base model's name"),
    ],
)
def test_bad_adapter_declarations_are_refused_at_start(value: object, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides={"model": "tiny-sd", "lora_modules": value})


def test_a_form_field_names_the_adapter_or_carries_it_as_json() -> None:
    """Edits and videos come as forms, whose fields are strings."""
    assert ImageEditRequest.model_validate({"prompt": "a", "lora": "pixel"}).lora == LoraChoice(
        name="pixel", scale=1
    )
    as_json = ImageEditRequest.model_validate({"prompt": "a", "lora": '{"name": "pixel", "scale": 0.6}'})
    assert as_json.lora == LoraChoice(name="pixel", scale=0.6)
    with pytest.raises(ValidationError, match="lora"):
        ImageEditRequest.model_validate({"prompt": "a", "lora": '{"name": '})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"lora": "broken"}, "lora"),
        ({"lora": {"name": "broken", "scale": 0.5}}, "lora"),
        ({"model": "broken"}, "model"),
        ({"lora": "broken", "stream": True}, "lora"),
    ],
)
async def test_an_adapter_that_fails_to_load_is_named_without_its_path_or_exception(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture, fields: dict[str, Any], param: str
) -> None:
    client = await make_client(lora_modules={**ADAPTERS, "broken": "/srv/models/customer-x"})
    with caplog.at_level(logging.INFO):
        response = await client.post(URL, json={"prompt": "a harbour", **fields})
    if fields.get("stream"):  # the stream had begun: the error is its last event
        assert response.status_code == 200
        event = json.loads(response.text.strip().splitlines()[-1].removeprefix("data: "))
        error = event["error"]
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert error["param"] == param and "'broken'" in error["message"], error
    for secret in ("/srv/models", "NoMatchingPeftModuleError", "tiny-sd"):
        assert secret not in response.text
    assert "/srv/models/customer-x" in caplog.text  # the operator reads why in the log


NESTED = '{"a":' * 50_000 + "1" + "}" * 50_000


async def test_a_lora_nested_thousands_deep_is_a_400_naming_it(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(lora_modules=ADAPTERS)
    image = {"image": ("a.png", png(8, 8), "image/png")}
    with caplog.at_level(logging.INFO):
        responses = [
            await client.post(URL, json={"prompt": "a", "lora": NESTED}),
            await client.post("/v1/images/edits", data={"prompt": "a", "lora": NESTED}, files=image),
            await client.post("/v1/videos", json={"prompt": "a", "lora": NESTED}),
            await client.post("/v1/videos", files={"prompt": (None, "a"), "lora": (None, NESTED)}),
        ]
    for response in responses:
        message = assert_error(response, 400, param="lora")
        assert len(message) < 500
    assert not [record for record in caplog.records if record.exc_info]  # no traceback
