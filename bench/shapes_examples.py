"""`python -m bench.shapes_examples [PNG] [--model MODEL]`: serve MODEL (default: the
trained `shapes`, the server's default), ask it for each of `EXAMPLES` with seeds 0-3 through
the official openai client, and save the pictures as one labelled grid (default:
docs/shapes-examples.png), each with the scorer's verdict: the README's "what the default
model draws".

The prompts are in several phrasings, none of them the template's; the server's own defaults
apply (64x64, 20 steps, guidance 4 for `shapes`).
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from openai import OpenAI
from PIL import Image, ImageDraw

from bench.launch import ROOT, start_server, stop_server
from pipelines.trained.quality import score

EXAMPLES = (
    "a white square on red",
    "please draw a big green cross in the top left corner on white",
    "draw a white circle on a black background",
    "two white crosses on a green background",
    "a big purple square, orange background",
    "a tiny black triangle in the middle with a yellow background",
    "one black cross in the upper right corner on yellow",
    # The first prompt: a large red shape on blue still comes out purple inside.
    "a red circle on a blue background",
)
SEEDS = (0, 1, 2, 3)
# Each 64x64 picture is shown this many times larger; the caption column is this wide.
_ZOOM = 2
_LABEL_WIDTH = 340
_GAP = 4


def draw_examples(base_url: str, model: str) -> list[list[np.ndarray]]:
    """Each example's pictures, one per seed, as the server draws them (sent all at once:
    the server batches them)."""
    client = OpenAI(base_url=base_url, api_key="unused")

    def draw(prompt: str, seed: int) -> np.ndarray:
        response = client.images.generate(
            model=model, prompt=prompt, size="64x64", extra_body={"seed": seed, "output_format": "png"}
        )
        encoded = response.data[0].b64_json if response.data else None
        if encoded is None:
            raise RuntimeError(f"no picture for {prompt!r}")
        with Image.open(io.BytesIO(base64.b64decode(encoded))) as image:
            return np.asarray(image.convert("RGB"))

    with ThreadPoolExecutor(len(EXAMPLES) * len(SEEDS)) as pool:
        futures = [[pool.submit(draw, prompt, seed) for seed in SEEDS] for prompt in EXAMPLES]
        return [[future.result() for future in row] for row in futures]


def grid(rows: list[list[np.ndarray]]) -> Image.Image:
    """The pictures in rows beside their prompt; a picture the scorer reads as showing its
    prompt's background and every shape's colour and kind gets a green bar, others red."""
    side = 64 * _ZOOM
    width = _LABEL_WIDTH + len(SEEDS) * (side + _GAP)
    sheet = Image.new("RGB", (width, len(rows) * (side + _GAP + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (prompt, pictures) in enumerate(zip(EXAMPLES, rows, strict=True)):
        top = r * (side + _GAP + 4)
        draw.text((6, top + side // 2 - 6), prompt, fill="black")
        for c, picture in enumerate(pictures):
            left = _LABEL_WIDTH + c * (side + _GAP)
            tile = Image.fromarray(picture).resize((side, side), Image.Resampling.NEAREST)
            sheet.paste(tile, (left, top))
            rates = score(picture, prompt).rates()
            right = all(rates.get(a, 1.0) == 1.0 for a in ("background", "colour", "shape"))
            bar = (left, top + side, left + side - 1, top + side + 3)
            draw.rectangle(bar, fill="green" if right else "red")
    return sheet


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shapes_examples", description=__doc__)
    parser.add_argument("png", nargs="?", type=Path, default=ROOT / "docs" / "shapes-examples.png")
    parser.add_argument("--model", default="shapes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(Path(workdir), args.model, config=None, ready_timeout_s=300)
        try:
            rows = draw_examples(server.v1, args.model)
        finally:
            stop_server(server)
    grid(rows).save(args.png)
    print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
