"""The contenders a benchmark compares: HTTP servers, and the pipeline called in-process.

- `ServerContender`: a `diffbatch serve` the benchmark started (or one at `--url`), driven
  over HTTP like any client would, with its own `/metrics` read around each round.
- `DirectContender` (`bench.direct`): the limit. The same requests, grouped by batch key into full batches
  (the engine's own scheduler with everything waiting at once) and run back to back in
  this process with no HTTP, no queueing and no encoding. A batch holds as many images as
  the load could ever offer at once (the concurrency or burst size, at most max_num_seqs;
  max_num_seqs for Poisson arrivals). Its "latency" is the forward that carried the
  request; arrival times do not matter to it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Protocol

import httpx
import numpy as np
from PIL import Image

from bench.drivers import Outcome, Sample, Send, bursts, closed_loop, open_loop
from bench.launch import ServerProcess
from bench.machine import VIDEO_MODALITIES
from bench.server_metrics import ServerFigures, Snapshot, figures_between, parse_metrics, paused
from bench.workload import RequestSpec, WorkloadKind

# A video job is polled at a twentieth of its age, 5-50 ms: a client learns of its end at
# most 5% (or 5 ms) late, where a fixed 50 ms added ~25 ms to a tiny model's 70 ms video.
VIDEO_POLL_MIN_S, VIDEO_POLL_MAX_S, VIDEO_POLL_FRACTION = 0.005, 0.05, 0.05
PAUSED_POLL_S = 0.25  # how often a round reads a server's paused-requests gauge


@dataclass(slots=True)
class RoundResult:
    samples: list[Sample]
    wall_s: float
    server: ServerFigures | None = None


@dataclass(frozen=True, slots=True)
class Load:
    """How one round sends its trace: the driver and its level."""

    kind: WorkloadKind
    level: float  # concurrency, burst size, or requests/s
    offsets: tuple[float, ...] = ()  # Poisson arrival times


@dataclass(frozen=True, slots=True)
class Pictures:
    """What a contender drew for a list of requests: one uint8 HxWx3 picture per request, in
    order (None where the request failed), and the first failure."""

    images: list[np.ndarray | None]
    error: str | None = None


class Contender(Protocol):
    name: str
    # Whether `pictures` honours `partial_images` (hands back the first preview).
    draws_previews: bool

    async def run(self, load: Load, specs: list[RequestSpec]) -> RoundResult: ...

    async def pictures(self, specs: list[RequestSpec], concurrency: int) -> Pictures:
        """The first picture of each request (`--quality`), `concurrency` requests at a time."""
        ...


def input_image(spec: RequestSpec) -> np.ndarray:
    """A deterministic picture to edit or animate, of the request's size."""
    rng = np.random.default_rng(spec.seed)
    return rng.integers(0, 256, (spec.height or 64, spec.width or 64, 3), dtype=np.uint8)


@cache
def _png(width: int | None, height: int | None, seed: int) -> bytes:
    spec = RequestSpec("", width, height, 1, None, 1, seed)
    buffer = io.BytesIO()
    Image.fromarray(input_image(spec)).save(buffer, format="PNG")
    return buffer.getvalue()


def control_image(spec: RequestSpec) -> np.ndarray:
    """A deterministic control image of the request's size, apart from its input image."""
    return input_image(replace(spec, seed=spec.seed + 1))


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _control_entry(spec: RequestSpec) -> dict[str, str]:
    """The `controlnet` entry of a request that names one: its control image as a data URL."""
    assert spec.controlnet is not None
    return {"name": spec.controlnet, "image": _data_url(_png(spec.width, spec.height, spec.seed + 1))}


@dataclass
class ServerContender:
    """An HTTP server speaking the OpenAI API; `process` is set when this run started it."""

    name: str
    url: str
    modality: str
    flags: str = ""
    draws_previews: bool = True
    api_key: str | None = None
    process: ServerProcess | None = None
    # Tenant i's requests (`tenants=K`) send `tenant_keys[i - 1]` as their API key.
    tenant_keys: tuple[str, ...] = ()
    # Send each request's deadline as its `timeout` field (a server that plans for deadlines).
    send_deadlines: bool = False
    _client: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(3600, connect=30),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def scrape(self) -> Snapshot:
        response = await self.client.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    async def run(self, load: Load, specs: list[RequestSpec]) -> RoundResult:
        before = await self.scrape()
        # A server that counts paused requests is watched during the round for its peak.
        peaks: list[float] = []
        watch = asyncio.create_task(self._watch_paused(peaks)) if paused(before) is not None else None
        try:
            samples = await drive(self.send, load, specs)
        finally:
            if watch is not None:
                watch.cancel()
        after = await self.scrape()
        wall = max((s.done for s in samples), default=0.0)
        figures = figures_between(before, after)
        if peaks:
            figures = replace(figures, paused_max=max([*peaks, figures.paused_max or 0.0]))
        return RoundResult(samples, wall, figures)

    async def _watch_paused(self, peaks: list[float]) -> None:
        while True:
            await asyncio.sleep(PAUSED_POLL_S)
            peaks.append(paused(await self.scrape()) or 0.0)

    async def send(self, spec: RequestSpec) -> Outcome:
        if self.modality in VIDEO_MODALITIES:
            return await self._video(spec)
        fields = _fields(spec, self.send_deadlines)
        headers = self._tenant_header(spec)
        if self.modality == "edit":
            if spec.controlnet is not None:  # a form's control parts are not sent yet
                raise ValueError("controlnet= is sent with generations only, not edits")
            files = {"image": ("input.png", _png(spec.width, spec.height, spec.seed), "image/png")}
            data = {k: str(v) for k, v in fields.items()}
            request = self.client.build_request(
                "POST", "/v1/images/edits", data=data, files=files, headers=headers
            )
        else:
            request = self.client.build_request(
                "POST", "/v1/images/generations", json=fields, headers=headers
            )
        response = await self.client.send(request, stream=True)
        try:
            first_byte = None
            body = b""
            async for chunk in response.aiter_bytes():
                first_byte = first_byte or time.perf_counter()
                body += chunk
        finally:
            await response.aclose()
        if response.status_code != 200:
            error = _error_text(response.status_code, body)
            return Outcome(ok=False, first_byte=first_byte, error=error, status=response.status_code)
        outputs = body.count(b".completed\n") if spec.stream or spec.partial_images else spec.n
        return Outcome(ok=True, outputs=outputs, first_byte=first_byte)

    async def pictures(self, specs: list[RequestSpec], concurrency: int) -> Pictures:
        drawn: dict[int, np.ndarray] = {}
        order = {id(spec): i for i, spec in enumerate(specs)}

        async def send(spec: RequestSpec) -> Outcome:
            # PNG: lossless, so PSNR measures the model and not the encoder.
            fields = {**_fields(spec), "output_format": "png"}
            response = await self.client.post("/v1/images/generations", json=fields)
            if response.status_code != 200:
                return Outcome(ok=False, error=_error_text(response.status_code, response.content))
            if spec.partial_images:  # the first preview is the picture wanted, not the final one
                encoded = _first_partial_image(response.text)
                if encoded is None:
                    return Outcome(ok=False, error="the stream brought no partial image")
            else:
                encoded = response.json()["data"][0]["b64_json"]
            with Image.open(io.BytesIO(base64.b64decode(encoded))) as image:
                drawn[order[id(spec)]] = np.asarray(image.convert("RGB"))
            return Outcome(ok=True, outputs=1)

        samples = await closed_loop(send, specs, concurrency)
        error = next((s.error for s in samples if s.error), None)
        return Pictures([drawn.get(i) for i in range(len(specs))], error)

    def _tenant_header(self, spec: RequestSpec) -> dict[str, str]:
        if spec.tenant is None or not self.tenant_keys:
            return {}
        return {"Authorization": f"Bearer {self.tenant_keys[spec.tenant - 1]}"}

    async def _video(self, spec: RequestSpec) -> Outcome:
        """A video job created, polled until it ends, and its MP4 downloaded: a client has
        its video once it has the bytes, as with an image (direct's ends at its frames)."""
        fields, headers = _fields(spec, self.send_deadlines), self._tenant_header(spec)
        if self.modality == "image-to-video":  # the picture it animates, as direct gets it
            fields["input_reference"] = _data_url(_png(spec.width, spec.height, spec.seed))
        response = await self.client.post("/v1/videos", json=fields, headers=headers)
        if response.status_code != 200:
            status = response.status_code
            return Outcome(ok=False, error=_error_text(status, response.content), status=status)
        video_id, created = response.json()["id"], time.perf_counter()
        while True:
            job = (await self.client.get(f"/v1/videos/{video_id}", headers=headers)).json()
            if job["status"] == "failed":
                return Outcome(ok=False, error=str(job.get("error")))
            if job["status"] == "completed":
                break
            await asyncio.sleep(video_poll_interval(time.perf_counter() - created))
        content = await self.client.get(f"/v1/videos/{video_id}/content", headers=headers)
        if content.status_code != 200:
            status = content.status_code
            return Outcome(ok=False, error=_error_text(status, content.content), status=status)
        return Outcome(ok=True, outputs=1)


def video_poll_interval(age_s: float) -> float:
    """Seconds until a video job `age_s` old is polled again."""
    return min(VIDEO_POLL_MAX_S, max(VIDEO_POLL_MIN_S, age_s * VIDEO_POLL_FRACTION))


def _fields(spec: RequestSpec, send_deadline: bool = False) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "prompt": spec.prompt,
        "size": "auto" if spec.width is None else f"{spec.width}x{spec.height}",
        "seed": spec.seed,
    }
    if spec.steps is not None:
        fields["num_inference_steps"] = spec.steps
    if spec.guidance is not None:
        fields["guidance_scale"] = spec.guidance
    if spec.negative_prompt is not None:
        fields["negative_prompt"] = spec.negative_prompt
    if spec.strength is not None:
        fields["strength"] = spec.strength
    if spec.model is not None:
        fields["model"] = spec.model
    if spec.priority is not None:
        fields["priority"] = spec.priority
    if spec.controlnet is not None:
        fields["controlnet"] = [_control_entry(spec)]
    if send_deadline and spec.deadline_s is not None:
        fields["timeout"] = spec.deadline_s
    if spec.seconds is not None:
        fields["seconds"] = spec.seconds
    else:
        fields["n"] = spec.n
        if spec.stream or spec.partial_images:
            fields["stream"] = True
        if spec.partial_images:
            fields["partial_images"] = spec.partial_images
    return fields


def _first_partial_image(stream: str) -> str | None:
    """The b64 picture of a server-sent event stream's first `*.partial_image` event."""
    for line in stream.splitlines():
        if line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            if str(event.get("type", "")).endswith(".partial_image"):
                encoded: str = event["b64_json"]
                return encoded
    return None


def _error_text(status: int, body: bytes) -> str:
    return f"HTTP {status}: {body[:300].decode(errors='replace')}"


async def drive(send: Send, load: Load, specs: list[RequestSpec]) -> list[Sample]:
    if load.kind == "poisson":
        return await open_loop(send, specs, load.offsets)
    if load.kind == "burst":
        return await bursts(send, specs, int(load.level))
    return await closed_loop(send, specs, int(load.level))
