"""The playground page in a real browser: headless Chromium (Debian's package) driven by
Playwright, against real servers: tiny-sd with an API key in step-level batching (and a
ControlNet and an IP-Adapter beside it), tiny-sd-inpaint for a painted mask, tiny-sd
through its img2img pipeline for a strength, and tiny-flux2-klein for an edit of several
images. Every wait is on what the page shows; the timeouts are only failsafes."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from bench.launch import spawn_server, wait_until_ready
from bench.playground_screenshot import FAILSAFE_MS, launch_chromium
from tests.e2e.conftest import Server, stop_server

pytestmark = pytest.mark.slow

KEY = "playground-test-key"
GENERATE = "#generate button[type=submit]"
BIG_SEED = 2**53 + 1


@dataclass
class Servers:
    keyed: Server  # tiny-sd with an API key, in step-level batching (previews stream), with a
    # ControlNet and an IP-Adapter (the generate tab offers a control and a reference image)
    inpaint: Server  # tiny-sd-inpaint without a key (it takes a mask)
    img2img: Server  # tiny-sd image-to-image without a key (it takes a strength)
    multi: Server  # tiny-flux2-klein without a key (it takes several references)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    # Started together, so that they load their models at once.
    keyed = spawn_server(
        tmp_path_factory.mktemp("keyed"),
        "--api-key",
        KEY,
        "--batching",
        "step",
        "--controlnet",
        "edges=tiny-sd-controlnet",
        "--ip-adapter",
        "style=tiny-sd-ip-adapter",
    )
    inpaint = spawn_server(tmp_path_factory.mktemp("inpaint"), "tiny-sd-inpaint", config=None)
    img2img = spawn_server(
        tmp_path_factory.mktemp("img2img"),
        "--pipeline-class",
        "pipelines.registry:StableDiffusionImageToImage",
    )
    multi = spawn_server(tmp_path_factory.mktemp("multi"), "tiny-flux2-klein", config=None)
    started = (keyed, inpaint, img2img, multi)
    try:
        for server in started:
            # A failsafe: four models load at once, on however few cores the machine has.
            wait_until_ready(server, 300)
        yield Servers(keyed, inpaint, img2img, multi)
    finally:
        for server in started:
            stop_server(server)


@pytest.fixture
def server(servers: Servers) -> Server:
    return servers.keyed


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page (its own sessionStorage: no key left from another test) that must end
    without a script error or anything refused by its Content-Security-Policy, which
    allows this server alone: a resource from elsewhere (a CDN, a font) would be refused."""
    context = browser.new_context()
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()
    assert not problems, problems


def open_with_key(page: Page, server: Server) -> None:
    page.goto(f"{server.url}/playground")
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")


def test_an_image_streams_in_and_the_live_panel_counts_its_forwards(page: Page, server: Server) -> None:
    open_with_key(page, server)
    expect(page.locator("#model")).to_have_value("tiny-sd", timeout=FAILSAFE_MS)  # /v1/models with the key
    # The model list says what each model makes (and, of several models, which are loaded).
    expect(page.locator("#model option").first).to_have_text("tiny-sd · image")
    labels = page.evaluate(
        """async () => {
            const { modelLabel } = await import("./api.js");
            return ["parked", "unloaded", "failed"].map((state) =>
                modelLabel({ id: "m", endpoints: ["video"], loaded: false, state }));
        }"""
    )
    assert labels == [
        "m · video · in host memory, back on use",
        "m · video · loads on first use",
        "m · video · failed to load",
    ]
    page.fill("#generate-prompt", "a watercolor fox")
    page.select_option("#partial-images", "2")
    page.fill("#seed", str(BIG_SEED))
    page.click(GENERATE)

    group = page.locator("#results .group")
    expect(group).to_have_attribute("data-state", "done", timeout=FAILSAFE_MS)
    expect(group).to_have_attribute("data-previews", "2")  # both previews came before the image
    image = group.locator("img[data-state=done]")
    expect(image).to_have_count(1)
    source = image.get_attribute("src") or ""
    assert source.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))) as png:
        assert png.format == "PNG" and png.size == (64, 64)
    # Sent and shown exactly, though a JavaScript number cannot hold it.
    expect(group.locator("figcaption")).to_contain_text(f"seed {BIG_SEED} · 64x64")

    # The panel scrapes /metrics with the key: the request's forwards (one per step) show.
    expect(page.locator("#stat-forwards")).to_have_text(re.compile(r"^[1-9]\d*$"), timeout=FAILSAFE_MS)
    expect(page.locator("#stat-mean")).to_have_text(re.compile(r"^\d+\.\d\d$"))


def test_without_the_key_the_page_shows_the_servers_401_message(page: Page, server: Server) -> None:
    refusal = httpx.post(f"{server.v1}/images/generations", json={"prompt": "a fox"})
    assert refusal.status_code == 401
    page.goto(f"{server.url}/playground")  # the page itself is static: no key needed
    expect(page.locator("#connection")).to_have_text("This server needs an API key.", timeout=FAILSAFE_MS)
    page.fill("#generate-prompt", "a fox")
    page.click(GENERATE)
    error = page.locator("#results .group[data-state=failed] .error")
    expect(error).to_have_text(refusal.json()["error"]["message"], timeout=FAILSAFE_MS)
    expect(page.locator("#live-note")).to_have_text("Enter the API key to see live metrics.")


def upload_for_edit(page: Page, photo: Path) -> None:
    page.click("[data-tab=edit]")
    page.set_input_files("#edit-image", photo)
    with Image.open(photo) as image:
        size = f"{image.width}x{image.height}"
    expect(page.locator("#mask-hint")).to_contain_text(size, timeout=FAILSAFE_MS)


def shown_image(page: Page) -> np.ndarray:
    """The one finished image the page shows, once it shows it, as RGB ints."""
    image = page.locator("#results .group[data-state=done] img[data-state=done]")
    expect(image).to_have_count(1, timeout=FAILSAFE_MS)
    source = image.get_attribute("src") or ""
    with Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))) as output:
        return np.asarray(output.convert("RGB")).astype(int)


def test_an_edit_with_a_painted_mask_repaints_only_the_painted_area(
    page: Page, servers: Servers, tmp_path: Path
) -> None:
    """Against an inpainting model (no key: the page's same-origin requests pass the
    cross-site guard): it keeps the input's pixels outside the mask, so what comes back
    shows which area the page's mask marked."""
    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (30, 120, 200)).save(photo)
    page.goto(f"{servers.inpaint.url}/playground")
    page.fill("#seed", "7")
    upload_for_edit(page, photo)
    box = page.locator("#mask-canvas").bounding_box()
    assert box is not None
    # One stroke across the middle, from a quarter to three quarters of the width.
    middle = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] / 4, middle)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 3 / 4, middle, steps=5)
    page.mouse.up()
    page.fill("#edit-prompt", "a red ball")
    page.click("#edit button[type=submit]")
    pixels = shown_image(page)
    assert pixels.shape == (48, 64, 3)
    kept = np.abs(pixels - (30, 120, 200)).max(axis=2) <= 1
    assert kept[0, 0] and kept[47, 63] and kept[24, 4] and kept[4, 32]  # far from the stroke
    assert not kept[24, 24:41].any()  # along the stroke: repainted


def test_an_edit_on_a_text_to_image_model_shows_the_servers_refusal(
    page: Page, server: Server, tmp_path: Path
) -> None:
    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (30, 120, 200)).save(photo)
    refusal = httpx.post(
        f"{server.v1}/images/edits",
        headers={"Authorization": f"Bearer {KEY}"},
        data={"prompt": "a red ball"},
        files={"image": photo.read_bytes()},
    )
    assert refusal.status_code == 400
    open_with_key(page, server)
    upload_for_edit(page, photo)
    page.fill("#edit-prompt", "a red ball")
    page.click("#edit button[type=submit]")
    error = page.locator("#results .group[data-state=failed] .error")
    expect(error).to_have_text(refusal.json()["error"]["message"], timeout=FAILSAFE_MS)


def test_an_edit_with_a_strength_is_the_servers_image_for_that_strength(
    page: Page, servers: Servers, tmp_path: Path
) -> None:
    """The Strength field reaches an image-to-image model: the page shows the image the
    server makes for that strength (and seed and steps) when asked directly."""
    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), np.uint8)).save(photo)

    def direct(strength: str) -> np.ndarray:
        response = httpx.post(
            f"{servers.img2img.v1}/images/edits",
            data={"prompt": "a red ball", "seed": "7", "num_inference_steps": "4", "strength": strength},
            files={"image": photo.read_bytes()},
            timeout=FAILSAFE_MS / 1000,
        )
        response.raise_for_status()
        with Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))) as image:
            return np.asarray(image.convert("RGB")).astype(int)

    page.goto(f"{servers.img2img.url}/playground")
    page.fill("#seed", "7")
    page.fill("#steps", "4")
    upload_for_edit(page, photo)
    page.fill("#edit-prompt", "a red ball")
    page.fill("#strength", "0.5")
    page.click("#edit button[type=submit]")
    shown = shown_image(page)
    assert np.abs(shown - direct("0.5")).max() <= 1
    assert np.abs(shown - direct("1.0")).mean() > 5  # another strength, another image


def test_an_edit_of_several_images_sends_them_all_in_order(
    page: Page, servers: Servers, tmp_path: Path
) -> None:
    """Several files chosen on the edit tab go as `image[]` parts, in the order chosen: the
    page shows the image a multi-reference model makes of the same two images posted directly,
    not of the first one alone."""
    photos = []
    for i, size in enumerate([(64, 64), (64, 96)]):
        photo = tmp_path / f"photo-{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), np.uint8)).save(
            photo
        )
        photos.append(photo)

    def direct(chosen: list[Path]) -> np.ndarray:
        response = httpx.post(
            f"{servers.multi.v1}/images/edits",
            data={"prompt": "a red ball", "seed": "7", "num_inference_steps": "3", "size": "64x64"},
            files=[("image[]", (photo.name, photo.read_bytes(), "image/png")) for photo in chosen],
            timeout=FAILSAFE_MS / 1000,
        )
        response.raise_for_status()
        with Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))) as image:
            return np.asarray(image.convert("RGB")).astype(int)

    page.goto(f"{servers.multi.url}/playground")
    page.fill("#seed", "7")
    page.fill("#steps", "3")
    page.select_option("#size", "64x64")
    page.click("[data-tab=edit]")
    page.set_input_files("#edit-image", photos)
    expect(page.locator("#mask-hint")).to_contain_text("2 images")
    page.fill("#edit-prompt", "a red ball")
    page.click("#edit button[type=submit]")
    shown = shown_image(page)
    assert np.abs(shown - direct(photos)).max() <= 1
    assert np.abs(shown - direct(photos[:1])).max() > 1  # the second image counted


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_a_control_and_a_reference_image_go_with_a_generation(
    page: Page, servers: Servers, tmp_path: Path
) -> None:
    """Where the model serves a ControlNet and an IP-Adapter, the generate tab offers a control
    and a reference image (neither is a model to pick): the page shows the image the server
    makes for both when asked directly, not the one for either alone; a union ControlNet adds
    the kind of control image (its `mode`). A model serving neither shows neither field."""
    control, reference = tmp_path / "control.png", tmp_path / "reference.png"
    for seed, path in enumerate((control, reference)):
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), np.uint8)).save(path)
    controlnet = [{"name": "edges", "image": data_url(control)}]
    ip_adapter = [{"name": "style", "image": data_url(reference), "scale": 0.7}]

    def direct(extra: dict[str, object]) -> np.ndarray:
        response = httpx.post(
            f"{servers.keyed.v1}/images/generations",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": "a cat", "seed": 7, "num_inference_steps": 4, "size": "64x64", **extra},
            timeout=FAILSAFE_MS / 1000,
        )
        response.raise_for_status()
        with Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))) as image:
            return np.asarray(image.convert("RGB")).astype(int)

    open_with_key(page, servers.keyed)
    expect(page.locator("#reference-fields")).to_be_visible(timeout=FAILSAFE_MS)
    expect(page.locator("#control-fields")).to_be_visible()
    expect(page.locator("#model option")).to_have_count(1)  # tiny-sd alone
    expect(page.locator("#ip-adapter-name option")).to_have_text(["style"])
    page.fill("#generate-prompt", "a cat")
    page.fill("#seed", "7")
    page.fill("#steps", "4")
    page.select_option("#size", "64x64")
    page.set_input_files("#control-image", control)
    page.set_input_files("#reference-image", reference)
    page.fill("#reference-scale", "0.7")
    page.click(GENERATE)
    shown = shown_image(page)
    assert np.abs(shown - direct({"controlnet": controlnet, "ip_adapter": ip_adapter})).max() <= 1
    assert np.abs(shown - direct({"controlnet": controlnet})).max() > 1  # the reference counted
    assert np.abs(shown - direct({"ip_adapter": ip_adapter})).max() > 1  # the control image counted

    # A union ControlNet offers the kind of control image, sent as the entry's `mode`. None fits
    # tiny-sd: the page's model list gets the card a server lists for one (`modes` by number).
    expect(page.locator("#control-mode-field")).to_be_hidden()  # edges reads one kind

    def with_union(route: Route) -> None:
        listed = route.fetch().json()
        union = {"id": "union", "created": 0, "parent": "tiny-sd", "kind": "controlnet"}
        listed["data"].append(union | {"object": "model", "modes": ["openpose", "depth"]})
        route.fulfill(json=listed)

    page.route("**/v1/models", with_union)
    page.dispatch_event("#api-key", "change")  # the model list again
    page.select_option("#controlnet-name", "union")
    expect(page.locator("#control-mode option")).to_have_text(["0 · openpose", "1 · depth"])
    page.select_option("#control-mode", "1")
    with page.expect_request("**/v1/images/generations") as sent:
        page.click(GENERATE)
    body = sent.value.post_data_json
    assert body is not None and body["controlnet"][0] | {"image": None} == {
        "name": "union",
        "image": None,
        "mode": 1,
    }

    page.goto(f"{servers.inpaint.url}/playground")
    expect(page.locator("#model")).to_have_value("tiny-sd-inpaint", timeout=FAILSAFE_MS)
    expect(page.locator("#control-fields")).to_be_hidden()
    expect(page.locator("#reference-fields")).to_be_hidden()
