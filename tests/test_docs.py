"""The README stays a front door, and its links into docs/ lead somewhere.

`mkdocs build --strict` (scripts/test) checks the links between the docs pages; the README is
not one of the site's pages, so its links are checked here, the way GitHub resolves them.
"""

from __future__ import annotations

import re

import pytest

from tests.doc_pages import ROOT, headings

README = ROOT / "README.md"
# A relative link, with an optional #anchor; absolute URLs and same-page anchors are left out.
LINK = re.compile(r"\]\((?!https?://|#)([^)#\s]+)(?:#([^)\s]+))?\)")


def github_anchor(title: str) -> str:
    """The id GitHub (and the site, through mkdocs.yml's slugify) gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def readme_links() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in LINK.finditer(README.read_text())]


def test_the_readme_is_a_front_door() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_to_every_docs_page() -> None:
    linked = {target for target, _ in readme_links()}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, f"the README does not link to docs/{page.name}"


@pytest.mark.parametrize(("target", "anchor"), readme_links())
def test_a_readme_link_leads_to_a_file_and_heading(target: str, anchor: str | None) -> None:
    path = ROOT / target
    assert path.exists(), f"{target} does not exist"
    if anchor is not None:
        anchors = {github_anchor(title) for _, _, title in headings(path.read_text())}
        assert anchor in anchors, f"{target} has no heading #{anchor}"


def test_the_anchor_rule_is_githubs() -> None:
    assert github_anchor("Running several servers (`--database-url`, `--output-url`)") == (
        "running-several-servers---database-url---output-url"
    )
    assert github_anchor("The default model: `shapes`") == "the-default-model-shapes"


def test_the_link_pattern_finds_relative_links_only() -> None:
    """With and without an anchor; not URLs, not anchors on the same page."""
    text = "[a](docs/a.md) [b](docs/b.md#x-y) [c](https://example.com/d.md) [e](#local)"
    assert [(m.group(1), m.group(2)) for m in LINK.finditer(text)] == [
        ("docs/a.md", None),
        ("docs/b.md", "x-y"),
    ]
