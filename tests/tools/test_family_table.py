"""The README's family table is the one the code generates (`python -m tools.family_table
--write` regenerates it), and a family added to the registry shows up in it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pipelines.families.base import Family, TaskUse
from pipelines.families.sdxl import StableDiffusionXL
from pipelines.tasks.base import TEXT_TO_IMAGE
from tools import family_table

# Reading each tiny model's class builds the tiny models not yet in the cache.
pytestmark = pytest.mark.slow


def test_the_readme_table_is_the_generated_one() -> None:
    assert family_table.readme_table(family_table.README.read_text()) == family_table.markdown(), (
        "README.md's family table is stale: run `python -m tools.family_table --write`"
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
