"""The task contract: what a kind of request (text-to-image, an edit, a video) adds to any
family that supports it, and text-to-image itself.

A task is a module-level object with no weights: it works through the family it is given
(`pipelines.families.base.Family`), so one task serves every family that declares it in its
`uses`, and no class is written per (family, task) pair.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import Modality
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.tasks.family import TaskFamily


class Task:
    """Text-to-image: the request's prompt and nothing else. Every hook is a no-op here;
    other tasks override the ones they need."""

    name: ClassVar[str] = "text-to-image"
    # Appended to a family's name to name the adapter composed for them (FluxTextToImage).
    suffix: ClassVar[str] = "TextToImage"
    modality: ClassVar[Modality] = "image"
    # How many input images a request must bring (min, max), and what else it may set.
    input_images: ClassVar[tuple[int, int]] = (0, 0)
    accepts_mask: ClassVar[bool] = False
    accepts_control_video: ClassVar[bool] = False
    accepts_strength: ClassVar[bool] = False
    accepts_frames: ClassVar[bool] = False
    # The diffusers argument for outputs per prompt, always 1 (n is expanded into prompts).
    per_prompt_argument: ClassVar[str] = "num_images_per_prompt"
    # Whether the family's weights go into the task's diffusers class through `from_pipe`
    # (the img2img and inpainting pipelines), rather than loading as their model index says.
    from_pipe: ClassVar[bool] = False
    # The output size when neither the request, its inputs nor the config give one, where
    # it is not the family's.
    default_size: ClassVar[tuple[int, int] | None] = None
    # The family primitives its recipes call besides the stages' (checked by a test).
    needs: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:
        return f"<task {self.name}>"

    def __reduce__(self) -> str:
        # One instance per task, compared by identity: a pickled adapter (a `spec()`) finds
        # the module's own (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, ...).
        return self.name.upper().replace("-", "_")

    # Admission: pure, runs in `spec()` too ------------------------------------------------

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        """(width, height) the request's inputs give it when it sets none, or None."""
        return None

    def check_inputs(self, family: TaskFamily, request: GenerationRequest) -> None:
        """Raise `InvalidRequestError` for input images the task cannot use (at admission,
        where the images are at hand)."""

    def complete(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        """Parameters after the defaults, with the task's own filled in."""
        return params

    def validate(self, family: TaskFamily, params: SamplingParams) -> None:
        """Raise `InvalidRequestError` for what the task cannot run."""

    def default_params(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        """The default request (the work budget's measure) with the task's own parameters."""
        return params

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        """What else requests sharing a request-level call must share."""
        return ()

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        """What else requests sharing a denoiser forward must share."""
        return ()

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        """A request's cost in a step, given the family's."""
        return cost

    def reduce_inputs(self, family: TaskFamily, request: GenerationRequest) -> GenerationRequest:
        return request

    # The request-level call ---------------------------------------------------------------

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {}

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        """The batch's input images as the diffusers call wants them."""
        return {}

    def outputs_of(self, result: Any) -> Any:
        """The generated arrays in a diffusers pipeline output."""
        return result.images

    def kept(
        self, family: TaskFamily, request: GenerationRequest, images: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Generated images (final or previews, uint8) as the request gets them."""
        return images

    # Step level -----------------------------------------------------------------------------

    def prompt_inputs(self, family: TaskFamily, owners: list[GenerationRequest]) -> dict[str, Any]:
        """What the text encoder reads besides the texts (a reference edit: each text's image)."""
        return {}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        """The request at its first step: its generators, its control images (FLUX's ControlNet
        pipeline samples their latents before the noise), its own schedule, its noise."""
        generators = generators_for(request)
        controls = family.control_images(request, generators)
        scheduler = family.scheduler(request)
        latents = family.noise(request, scheduler, generators, prompts[0])
        state = family.state(request, scheduler, latents, generators, prompts)
        state.control_images = controls
        return state

    def denoise(
        self, family: TaskFamily, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning
    ) -> Tensor:
        return family.denoise(states, latents, timesteps, cond)


TEXT_TO_IMAGE = Task()
