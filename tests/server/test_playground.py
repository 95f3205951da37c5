"""The playground's files: served at /playground/ without a key (the page is static), with
its security headers, gone with `disable_playground`, and shipped in the wheel."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from pipelines.trained.captions import normalise, parse_caption
from server.routes.playground import ASSETS, CONTENT_SECURITY_POLICY
from tests.server.conftest import ClientFactory
from tests.server.test_images_api import assert_error


async def test_the_page_is_served_without_a_key_and_allows_only_this_server(
    make_client: ClientFactory,
) -> None:
    client = await make_client(api_key="k")
    redirect = await client.get("/playground")
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/playground/")
    page = await client.get("/playground/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    script = await client.get("/playground/app.js")
    # ES modules run only when served as JavaScript.
    assert script.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
    assert (await client.get("/v1/models")).status_code == 401  # the API still needs the key
    # Counted under the mount's prefix, not as unmatched (and not one label per file).
    metrics = (await client.get("/metrics", headers={"Authorization": "Bearer k"})).text
    assert 'diffbatch_requests_total{endpoint="/playground",status="200"} 2.0' in metrics


async def test_disable_playground_answers_404(make_client: ClientFactory) -> None:
    client = await make_client(disable_playground=True)
    for path in ("/playground", "/playground/", "/playground/app.js"):
        assert_error(await client.get(path), 404)


def test_every_playground_file_is_package_data() -> None:
    """A file the globs of pyproject.toml miss would be absent from a non-editable install."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["server"]
    files = [path.relative_to(ASSETS.parent).as_posix() for path in ASSETS.iterdir()]
    assert "playground/index.html" in files
    for name in files:
        assert any(fnmatch.fnmatch(name, glob) for glob in globs), name


async def test_the_prompt_box_starts_with_an_example_and_offers_more_the_default_model_reads(
    make_client: ClientFactory,
) -> None:
    """The examples are captions of the shapes world (the default model's parser reads each,
    with a background and a coloured shape), in more than one phrasing."""
    page = (await (await make_client()).get("/playground/")).text
    start = re.search(r'<textarea id="generate-prompt"[^>]*>([^<]+)</textarea>', page)
    examples = re.findall(r'<button type="button" class="example">([^<]+)</button>', page)
    assert start is not None and start[1] in examples and len(examples) >= 3
    for example in examples:
        ask = parse_caption(example)
        assert ask.background is not None and all(o.colour for o in ask.objects), example
    assert len({normalise(e).split()[-1] for e in examples}) > 1  # not all "... background"
