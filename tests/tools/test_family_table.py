"""The family table of the README and docs/models.md is the one the code generates
(`python -m tools.family_table --write` regenerates it), and a family added to the
registry shows up in it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pipelines.families.base import Family, TaskUse
from pipelines.families.sdxl import StableDiffusionXL
from pipelines.tasks.base import TEXT_TO_IMAGE
from tools import family_table
from tools.presets import ROOT

# Reading each tiny model's class builds the tiny models not yet in the cache.
pytestmark = pytest.mark.slow


def test_every_page_with_the_table_holds_the_generated_one() -> None:
    holding = family_table.pages()
    assert [path.relative_to(ROOT).as_posix() for path in holding] == ["README.md", "docs/models.md"]
    generated = family_table.markdown()
    for path in holding:
        assert family_table.page_table(path.read_text()) == generated, (
            f"{path.name}'s family table is stale: run `python -m tools.family_table --write`"
        )


class LaterFamily(Family):
    """A family added after this table was written, serving SDXL's class (so its tiny model)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(TEXT_TO_IMAGE, "StableDiffusionXLPipeline"),)
    steps = StableDiffusionXL.steps


def test_a_family_added_later_appears_with_its_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(family_table, "FAMILIES", (LaterFamily,))
    rows = family_table.rows()
    assert [row.family for row in rows] == ["LaterFamily (`StableDiffusionXLPipeline`)", family_table.GENERIC]
    later = rows[0]
    assert later.tiny == "`tiny-sdxl`" and "`configs/sdxl.yaml`" in later.presets
    assert (later.endpoint, later.request_level, later.step_level, later.lora) == (
        "images",
        "yes",
        "yes",
        "yes",
    )
    # The generic adapter's tiny models: PixArt-Sigma and Sana at least.
    assert "`tiny-pixart-sigma`" in rows[-1].tiny and "`tiny-sana`" in rows[-1].tiny
