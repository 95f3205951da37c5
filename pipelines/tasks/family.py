"""The family as a task sees it: every member of a family that a task's hooks call.

A task works through the family it is given (`pipelines.families.base.Family` implements
this), so the tasks need only this interface, never the family classes: the families import
the tasks (their `uses` name them), and no import goes back. The defaults and what each
member means are `Family`'s; here is only what the tasks may rely on.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.base import PipelineConfig
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded


class UseFlags(Protocol):
    """What a task reads of the family's use (`pipelines.families.base.TaskUse`)."""

    @property
    def one_image_per_call(self) -> bool: ...


class TaskFamily(Protocol):
    # What the family holds: the loaded pipeline, its config and use, where inputs go, the
    # size multiple and the lock every VAE call takes.
    @property
    def pipe(self) -> Any: ...
    @property
    def config(self) -> PipelineConfig: ...
    @property
    def use(self) -> UseFlags: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def size_multiple(self) -> int: ...
    @property
    def vae_lock(self) -> threading.Lock: ...

    # Its class's rules.
    @property
    def flow_matching(self) -> bool: ...
    @property
    def samples_input_latents(self) -> bool: ...
    @property
    def default_fps(self) -> int: ...
    @property
    def default_num_frames(self) -> int: ...

    def frame_step(self) -> int: ...
    def size_from_image(self, image: Any) -> tuple[int, int] | None: ...

    # The step hooks a task's recipe runs.
    def scheduler(self, request: GenerationRequest) -> Any: ...
    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor: ...
    def state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState: ...
    def denoise(
        self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning
    ) -> Tensor: ...
    def control_images(
        self, request: GenerationRequest, generators: list[torch.Generator]
    ) -> tuple[Tensor, ...]: ...

    # The input-media primitives (`Task.needs` names those a task calls).
    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor: ...
    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]: ...
    def noised(
        self, scheduler: Any, image: Tensor, noise: Tensor, first: int, *, full: bool = False
    ) -> Tensor: ...
    def pack(self, latents: Tensor, request: GenerationRequest) -> Tensor: ...
    def skipped_steps(self, steps: int, strength: float) -> int: ...
    def reads_mask(self) -> bool: ...
    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]: ...
    def reference_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor: ...
    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]: ...
    def check_references(self, request: GenerationRequest) -> None: ...
    def reference_call_kwargs(self) -> dict[str, Any]: ...
    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None: ...
    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]: ...
    def reduce_references(self, request: GenerationRequest) -> GenerationRequest: ...
    def image_to_video_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor: ...
    def control_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor: ...
