"""`python -m bench.playground_screenshot [PNG] [--model MODEL]`: serve MODEL (default: the
trained `shapes`, the server's default) with an API key, generate a shapes caption from the
playground in headless Chromium (four requests at once, so the live panel shows them
batching) and save the page as PNG (default: docs/playground.png).

Needs Debian's `chromium` and Playwright (the `test` extra); `launch_chromium` is shared
with the browser tests.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from bench.launch import ROOT, start_server, stop_server

KEY = "playground-demo"
# A caption the shapes models were trained to draw (pipelines/trained/captions.py).
PROMPT = "a large red circle and a small yellow square on a blue background"
# Only a failsafe: every wait below ends as soon as the page shows what it waits for.
FAILSAFE_MS = 120_000


def launch_chromium(playwright: Playwright) -> Browser:
    """Headless Chromium from the system (Debian's package), not a Playwright download."""
    executable = shutil.which("chromium")
    if executable is None:
        raise RuntimeError("chromium is not installed: apt-get install chromium (scripts/test does it)")
    # As root (CI), Chromium's sandbox cannot start.
    return playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])


def generate_batch(page: Page, url: str) -> None:
    """Open the playground, enter the key and send four requests at once; return when all
    four images are done and the live panel shows all their forwards."""
    page.goto(f"{url}/playground")
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")  # `change`: the page loads the models and starts the live panel
    expect(page.locator("#live-state")).to_have_class(re.compile(r"\bon\b"), timeout=FAILSAFE_MS)
    page.fill("#seed", "42")
    page.fill("#generate-prompt", PROMPT)
    page.fill("#copies", "4")
    page.click("#generate button[type=submit]")
    done = page.locator("#results .group[data-state=done]")
    expect(done).to_have_count(4, timeout=FAILSAFE_MS)
    # The server's count is final now; the panel shows it at its next scrape.
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    forwards = re.search(r"^diffbatch_batch_size_count (\S+)$", metrics, re.MULTILINE)
    assert forwards is not None, metrics
    expect(page.locator("#stat-forwards")).to_have_text(str(int(float(forwards[1]))), timeout=FAILSAFE_MS)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.playground_screenshot", description=__doc__)
    parser.add_argument("png", nargs="?", type=Path, default=ROOT / "docs" / "playground.png")
    parser.add_argument("--model", default="shapes", help="what the server serves (default: shapes)")
    args = parser.parse_args(argv)
    target = args.png
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(
            Path(workdir),
            args.model,
            "--api-key",
            KEY,
            "--batching",
            "step",
            "--num-threads",
            "2",
            config=None,
        )
        try:
            with sync_playwright() as playwright:
                browser = launch_chromium(playwright)
                page = browser.new_page(viewport={"width": 1440, "height": 720})
                generate_batch(page, server.url)
                page.screenshot(path=str(target), animations="disabled")
                browser.close()
        finally:
            stop_server(server)
    print(f"saved {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
