"""`python -m bench.front_end` for a few seconds: a real server of the fixed-cost pipeline,
every kind of answer measured and tabled for each contender (two checkouts' code: here
both this one), and the picture it serves compressing as a photograph does."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench.front_end import main, photo
from bench.launch import ROOT

pytestmark = pytest.mark.slow


def test_every_kind_of_answer_is_measured_for_each_contender(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--sizes",
        "32",
        "--formats",
        "png,jpeg",
        "--requests",
        "4",
        "--rounds",
        "1",
        "--concurrency",
        "2",
    ]
    assert main([*args, "--source", f"a={ROOT}", "--source", f"b={ROOT}"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32²")]
    kinds = [tuple(cell.strip() for cell in row.split("|")[2:4]) for row in rows]
    assert kinds == [(f, a) for f in ("png", "jpeg") for a in ("b64", "url", "stream")]
    for row in rows:
        a, b, ratio = (float(cell) for cell in row.split("|")[4:7])
        assert a > 0 and b > 0 and ratio == pytest.approx(b / a, abs=0.01)


def test_the_picture_compresses_as_a_photograph() -> None:
    image = photo(256, 128)
    assert image.shape == (128, 256, 3) and not image.flags.writeable
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    assert 0.4 < len(png.getvalue()) / image.nbytes < 0.8  # not noise (1.0), not flat (~0)
    assert np.array_equal(photo(256, 128), image)
