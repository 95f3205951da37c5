"""`PipelineSpec`: what the engine needs of a pipeline on its own event loop (admission,
batch and step keys, costs): cheap, pure calls. A leaf: the plain request types only."""

from __future__ import annotations

from typing import Protocol

from engine.request import BatchKey, ControlRef, GenerationRequest, IPAdapterRef, SamplingParams


class PipelineSpec(Protocol):
    """What the engine needs of a pipeline on its own event loop: cheap, pure calls."""

    @property
    def supports_request_batch(self) -> bool: ...

    @property
    def supports_step_batch(self) -> bool: ...

    @property
    def modality(self) -> str: ...

    @property
    def accepts_control_video(self) -> bool:
        """Whether a request may bring a control video (Wan VACE)."""
        ...

    def resolve(self, request: GenerationRequest) -> SamplingParams: ...

    def validate(self, params: SamplingParams) -> None: ...

    def validate_inputs(self, num_images: int, has_mask: bool) -> None: ...

    def validate_controls(self, controls: tuple[ControlRef, ...]) -> None:
        """Refuse ControlNets this model does not serve (400 naming `controlnet[i].name`)."""
        ...

    def validate_ip_adapters(self, refs: tuple[IPAdapterRef, ...], params: SamplingParams) -> None:
        """Refuse IP-Adapters this model does not serve (400 naming `ip_adapter[i].name`), or
        that do not go with the request's resolved `params` (400 naming that field)."""
        ...

    def batch_key(self, request: GenerationRequest) -> BatchKey: ...

    def step_key(self, request: GenerationRequest) -> BatchKey: ...

    def step_cost(self, request: GenerationRequest) -> int: ...

    def step_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        """The token grid of the request's rows where its step key leaves the size out (a
        family that steps rows of different sizes in one forward pads them to the grid that
        holds them all, which the step budget counts); () where the key fixes the size."""
        ...

    def step_packs(self, request: GenerationRequest) -> bool:
        """Whether the request's rows are packed end to end beside rows of other sizes
        rather than padded to the grid (`step_grid`): a step group of such requests alone
        costs their own tokens."""
        ...

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest: ...
