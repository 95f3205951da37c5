"""The prepare / step / finish / preview stages of `pipelines.base.Pipeline` in step mode,
driving a family's hooks around `pipelines.stepping.state.step_together`."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from engine.request import GenerationRequest, LoraRef, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.outputs import resolved, split_outputs, to_arrays
from pipelines.stepping.preview import LinearPreview
from pipelines.stepping.state import Conditioning, Encoded, classifier_free, concatenate, step_together
from pipelines.timing import CudaTimer, device_timer


class SteppedStages:
    """The prepare / step / finish stages of `pipelines.base.Pipeline`, for a family that
    fills in the hooks below. Mixed in before the family's request-level adapter.

    `finish` may run on a decode thread while `prepare`, `step` and `preview` run on the
    stepping thread (`engine.decoding`): every VAE call holds `vae_lock`, because VAEs keep
    per-call caches (Wan's and Qwen-Image's causal convolutions clear and fill a feature
    cache on each encode and decode)."""

    supports_step_batch: ClassVar[bool] = True
    config: PipelineConfig  # the adapter's own
    pipe: Any  # the diffusers pipeline
    device: torch.device  # where its inputs go (the adapter's)
    use_lora: Callable[[SamplingParams], None]  # the request-level adapter's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vae_lock = threading.Lock()
        # With `preview_decoder: linear`: the latent-to-RGB map, fitted on the final decodes
        # of requests that preview.
        self.linear_preview = LinearPreview()

    def __getstate__(self) -> dict[str, Any]:
        # Locks do not pickle (`spec()` crosses to another process); a copy gets its own.
        state = dict(self.__dict__)
        state.pop("vae_lock", None)
        state.pop("linear_preview", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.vae_lock = threading.Lock()
        self.linear_preview = LinearPreview()

    def stage_timer(self) -> CudaTimer | None:
        """CUDA events on a GPU (the runner times each step on the device, not its kernel
        launches); None on the CPU: the host's clock."""
        return device_timer(self.device)

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        # Joiners are encoded together per LoRA adapter: an adapter may change the text
        # encoder too.
        groups: dict[LoraRef | None, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.params.lora, []).append(index)
        states: list[Any] = [None] * len(requests)
        with torch.inference_mode():
            for indices in groups.values():
                joiners = [requests[i] for i in indices]
                self.use_lora(joiners[0].params)
                encoded = zip(indices, joiners, self._encode(joiners), strict=True)
                for index, request, (cond, uncond) in encoded:
                    states[index] = self._prepare(request, cond, uncond)
        return states

    def step(self, states: list[Any]) -> None:
        def denoise(latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            return self._denoise(states, latents, timesteps, cond)

        self.use_lora(states[0].request.params)  # the adapter is in the step key: one per group
        with torch.inference_mode():
            step_together(states, denoise, self._merge, self._guide)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        finished = RequestBatch(key=(), requests=tuple(state.request for state in states))
        latents = torch.cat([state.latents for state in states])
        if states[0].request.params.output_type == "latent":
            return split_outputs(finished, to_arrays(latents, "latent"))
        with torch.inference_mode():
            with self.vae_lock:
                images = self._decode(states, latents)
            self._learn_previews(states, latents, images)
        return split_outputs(finished, to_arrays(images, "np"))

    def _learn_previews(self, states: list[Any], latents: torch.Tensor, images: Any) -> None:
        """Give the linear preview the final images of the requests that asked for previews,
        to fit on its own thread (`LinearPreview.observe_later`). Nobody previewing, no fit:
        it would copy every final image to the CPU for nothing."""
        linear = self._linear()
        rows: list[int] = []
        start = 0
        for state in states:
            if state.preview_at:
                rows.extend(range(start, start + state.num_images))
            start += state.num_images
        if linear is None or not rows:
            return
        grid = self._latent_grid(states, latents)
        if grid is None:
            return
        if len(rows) < start:  # new tensors: nothing here changes what the fit reads
            grid, images = grid[rows], np.asarray(images)[rows]
        linear.observe_later(grid, images)

    def preview(self, states: list[Any]) -> list[tuple[np.ndarray, ...]]:
        """Decode the clean-latent estimates of `states` (one size) together: one preview
        tuple (n images) per state. With the VAE a preview goes through the family's own
        decode (and safety checker), as the final image does; with `linear` through the
        fitted map, once it has seen enough images."""
        latents = torch.cat([state.preview for state in states])
        with torch.inference_mode():
            linear = self._linear()
            grid = None if linear is None or not linear.ready else self._latent_grid(states, latents)
            if linear is not None and grid is not None:
                params = states[0].request.params
                images = linear.decode(grid, resolved(params.height), resolved(params.width))
            else:
                with self.vae_lock:
                    images = to_arrays(self._decode(states, latents), "np")
        previews, start = [], 0
        for state in states:
            previews.append(tuple(images[start : start + state.num_images]))
            start += state.num_images
        return previews

    def _linear(self) -> LinearPreview | None:
        # A safety checker judges decoded images: previews then go through it, as finals do.
        if self.config.preview_decoder != "linear" or getattr(self.pipe, "safety_checker", None) is not None:
            return None
        return self.linear_preview

    def _latent_grid(self, states: list[Any], latents: torch.Tensor) -> torch.Tensor | None:
        """Latents as (B, C, h, w), one vector per latent pixel, for the linear preview; None
        where the family has no such view (video)."""
        return latents if latents.ndim == 4 else None

    @abstractmethod
    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        """Every joiner's conditioning, in one text-encoder call where the family allows."""

    @abstractmethod
    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        """The request's state: its own scheduler copy, latents from its generators."""

    @abstractmethod
    def _denoise(
        self, states: list[Any], latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """One denoiser forward over the merged rows of `states`, each at its own timestep."""

    @abstractmethod
    def _decode(self, states: list[Any], latents: torch.Tensor) -> Any:
        """Latents of finished requests (one size) to float images in [0, 1], HxWx3 numpy."""

    def _merge(self, conds: list[Conditioning]) -> Conditioning:
        return concatenate(conds)

    def _guide(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        return classifier_free(uncond, cond, scale)
