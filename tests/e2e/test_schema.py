"""schemathesis against the server's own OpenAPI description: property-based requests to
every route of a real server (bounded examples). No answer may be a 5xx, and every answer
must match what the description says: its status codes, content types, headers and bodies.

Server-side limits the schema cannot express (a model without `strength`, the work budget)
are answered 400 with an error object, which the description documents; so the check that
every schema-valid request is accepted is not among these."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from tests.e2e.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A small work budget keeps every generated request that is accepted quick.
    server = start_server(tmp_path_factory.mktemp("schema"), "--max-request-work", str(64 * 64 * 8))
    yield server
    stop_server(server)


def test_every_route_answers_as_it_is_described(api: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 10  # every route's description is usable

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def answers_as_described(case: Any) -> None:
            # A generous timeout: on a loaded machine a generation may wait its turn for long
            # (schemathesis' own default, 10 s, failed when the suite ran twice in parallel).
            case.call_and_validate(base_url=api.url, checks=CHECKS, timeout=300)

        answers_as_described()
    answered = sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{api.url}/metrics").text.splitlines()
        if line.startswith("diffbatch_requests_total{")
    )
    assert answered >= 5 * len(operations)  # the examples did reach the server


def test_the_description_has_no_422_and_documents_our_errors(api: Server) -> None:
    description = httpx.get(f"{api.url}/openapi.json").json()
    responses = description["paths"]["/v1/images/generations"]["post"]["responses"]
    assert "422" not in responses and {"400", "415", "429", "503"} <= set(responses)
