"""ControlNets served beside a model (`--controlnet NAME=SOURCE`), batched step by step: what
every family's ControlNets share (the request's control images reduced before queueing, the
rows each ControlNet steers at a step), and the UNet families' ControlNets.

A request names the ControlNets it uses, each with a control image, a scale and a window of
its steps (`engine.request.ControlRef`). In a shared step the family asks `residuals` for the
down and mid residuals of the whole forward: each ControlNet runs once, on the rows of the
requests that use it at this step (both halves of a request with classifier-free guidance,
as diffusers' `StableDiffusionControlNetPipeline` does without guess mode), its output is
scaled per row (0 outside a row's window: diffusers' `controlnet_keep`), and rows without
control get zeros, which the UNet adds without changing a bit. A request's k-th ControlNets
add in order, as diffusers' `MultiControlNetModel` sums them, so each request's image is
the one diffusers makes for it alone. SDXL's union ControlNet fuses a request's control images
in one pass instead (`pipelines.controlnet_union`); FLUX.1's ControlNets are
`pipelines.controlnet_flux`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from diffusers import ControlNetModel, ControlNetUnionModel
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import Tensor

from engine.request import ControlRef, GenerationRequest, InvalidRequestError
from pipelines.controlnet_union import Passed, fused_rows, run_fused
from pipelines.outputs import resolved
from pipelines.stepping.state import DenoiseState
from pipelines.tiny.controlnet import is_tiny_controlnet, tiny_controlnet_dir

# What the UNet takes from them, by argument name.
Residuals = dict[str, Any]
RESIDUAL_ARGUMENTS = ("down_block_additional_residuals", "mid_block_additional_residual")


def reduced_controls(request: GenerationRequest) -> GenerationRequest:
    """`request` with each control image resized to its output size, as diffusers'
    control image processor resizes it (Lanczos), so a queued request holds no more."""
    width, height = resolved(request.params.width), resolved(request.params.height)
    controls = tuple(
        _with_image(control, _resized(control.image, width, height)) for control in request.controls
    )
    return _with_controls(request, controls)


def _resized(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Exactly `width` x `height`, as the processor's own resize (PIL, Lanczos) would make it
    later: resizing to the size it already has is then a copy."""
    if image.shape[:2] == (height, width):
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.LANCZOS))


def _with_image(control: ControlRef, image: np.ndarray) -> ControlRef:
    return replace(control, image=image)


def _with_controls(request: GenerationRequest, controls: tuple[ControlRef, ...]) -> GenerationRequest:
    return replace(request, controls=controls)


def check_modes(controls: tuple[ControlRef, ...], modes: dict[str, int], *, fused: bool = False) -> None:
    """Raise `InvalidRequestError` naming `controlnet[i].mode` where a union ControlNet (`modes`:
    its number of modes) gets no mode or one it lacks, or another ControlNet gets one; with
    `fused` (SDXL's union ControlNet, one pass for all of a request's images), naming
    `controlnet[i].name` where a request mixes it with another ControlNet."""
    for index, control in enumerate(controls):
        count, field = modes.get(control.name, 0), f"controlnet[{index}].mode"
        if count and (control.mode is None or not 0 <= control.mode < count):
            raise InvalidRequestError(
                f"{field}: {control.name!r} is a union ControlNet: give the control image's mode, "
                f"0 to {count - 1}" + ("" if control.mode is None else f", not {control.mode}"),
                field,
            )
        if not count and control.mode is not None:
            raise InvalidRequestError(
                f"{field}: {control.name!r} takes no mode (only a union ControlNet with modes does; "
                "Qwen-Image's reads the kind of control from the image)",
                field,
            )
    union = next((control.name for control in controls if modes.get(control.name, 0)), None)
    if fused and union is not None:
        for index, control in enumerate(controls):
            if control.name != union:
                raise InvalidRequestError(
                    f"controlnet[{index}].name: a request that uses the union ControlNet {union!r} "
                    "names no other ControlNet (it fuses the request's control images in one pass, "
                    f"as diffusers' SDXL union pipeline does): give {union!r} each image with its mode",
                    f"controlnet[{index}].name",
                )


class ControlNetSet(Protocol):
    """What the stages read of a family's ControlNets, whatever the family."""

    nets: dict[str, Any]
    # Whether a union ControlNet fuses a request's control images in one pass (SDXL's), so a
    # request using one may use no other, rather than running once per image (FLUX.1's).
    fuses_union: bool

    def modes(self) -> dict[str, int]:
        """Each ControlNet's number of control modes (a union ControlNet's), 0 for the others."""
        ...

    def images(
        self, request: GenerationRequest, generators: list[torch.Generator], device: torch.device
    ) -> tuple[Tensor, ...]:
        """Each of the request's control images as its ControlNet reads it (one row, or one
        per image where each image draws its own: `DenoiseState.control_images`), drawing
        from the request's generators where the family's ControlNet pipeline does (before
        the noise: the task's prepare calls it first); the caller holds the `vae_lock`."""
        ...


class ControlNets:
    """The ControlNets served beside one model, loaded at start on its UNet's device and dtype."""

    fuses_union = True

    def __init__(self, nets: dict[str, Any], vae_scale_factor: int) -> None:
        self.nets = nets
        self.unions = {name for name, net in nets.items() if isinstance(net, ControlNetUnionModel)}
        # As the ControlNet pipelines' `control_image_processor`: resize, [0, 1], RGB.
        self.processor = VaeImageProcessor(
            vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False
        )

    @classmethod
    def load(cls, pipe: Any, sources: tuple[tuple[str, str], ...]) -> ControlNets:
        nets = {name: _load_one(name, source, pipe) for name, source in sources}
        return cls(nets, pipe.vae_scale_factor)

    def modes(self) -> dict[str, int]:
        return {
            name: int(net.config.num_control_type) if name in self.unions else 0
            for name, net in self.nets.items()
        }

    def images(
        self, request: GenerationRequest, generators: list[torch.Generator], device: torch.device
    ) -> tuple[Tensor, ...]:
        """Each control image as the pipeline's `prepare_image` makes it (one row, in the
        ControlNet's dtype); nothing is drawn."""
        width, height = resolved(request.params.width), resolved(request.params.height)
        return tuple(
            self.processor.preprocess(Image.fromarray(control.image), height=height, width=width)
            .to(dtype=torch.float32)
            .to(device=device, dtype=self.nets[control.name].dtype)
            for control in request.controls
        )

    def residuals(
        self, states: list[DenoiseState], latents: Tensor, timesteps: Tensor, cond: dict[str, Any]
    ) -> Residuals | None:
        """The UNet's residual arguments for a forward over `states`' rows, or None when no
        row is controlled at this step. `cond`: the ControlNet's own arguments by name, each
        a tensor of one row per row of `latents` (SDXL's `added_cond_kwargs`: a dict of them)."""
        slots = max((len(state.request.controls) for state in states), default=0)
        total: Passed | None = None
        for slot in range(slots):
            used = {name: rows for name, rows in _slot_rows(states, slot).items() if name not in self.unions}
            if not used:
                continue
            summed = self._slot(used, latents, timesteps, cond)
            total = summed if total is None else _add(total, summed)
        for (name, *_), rows in fused_rows(states, self.unions).items():
            index = torch.tensor(rows.index, device=latents.device)
            own = run_fused(self.nets[name], rows, latents[index], timesteps[index], _taken(cond, index))
            placed = _placed(own, index, latents)
            total = placed if total is None else _add(total, placed)
        if total is None:
            return None
        return {"down_block_additional_residuals": total[0], "mid_block_additional_residual": total[1]}

    def _slot(
        self, used: dict[str, _Rows], latents: Tensor, timesteps: Tensor, cond: dict[str, Any]
    ) -> Passed:
        """The residuals of one slot (each request's k-th ControlNet), zeros on other rows."""
        full: Passed | None = None
        for name, rows in used.items():
            index = torch.tensor(rows.index, device=latents.device)
            own_down, own_mid = self.nets[name](
                latents[index],
                timesteps[index],
                controlnet_cond=torch.cat(rows.images),
                conditioning_scale=1.0,
                return_dict=False,
                **_taken(cond, index),
            )
            # Per row, as diffusers scales a whole call by its one float.
            scale = torch.tensor(rows.scales, dtype=torch.float32, device=latents.device).view(-1, 1, 1, 1)
            down = [(sample * scale).to(sample.dtype) for sample in own_down]
            full = _placed((down, (own_mid * scale).to(own_mid.dtype)), index, latents, full)
        assert full is not None
        return full


@dataclass
class _Rows:
    """Rows of one forward that one ControlNet steers at this step."""

    index: list[int] = field(default_factory=list)
    images: list[Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


def slot_controls(states: list[DenoiseState], slot: int) -> Iterator[tuple[DenoiseState, int, str, float]]:
    """Each request that uses a `slot`-th ControlNet steering it at its step: its state, the
    offset of its first row in the forward, the ControlNet's name and its scale at this step.
    Rows lie as the step lays them out: each request's negative rows, then its positive rows
    (`state.rows` in all). Outside its window diffusers adds the residuals times 0: the
    request is left out, and its rows get zeros."""
    offset = 0
    for state in states:
        controls = state.request.controls
        if slot < len(controls):
            control = controls[slot]
            scale = control.keep(state.steps_done, state.total_steps)
            if scale != 0.0:
                yield state, offset, control.name, scale
        offset += state.rows


def _slot_rows(states: list[DenoiseState], slot: int) -> dict[str, _Rows]:
    """For each ControlNet that some request uses as its `slot`-th and that steers it at its
    step: the rows (both halves of a guided request), control images and scales."""
    used: dict[str, _Rows] = {}
    for state, offset, name, scale in slot_controls(states, slot):
        rows = used.setdefault(name, _Rows())
        rows.index.extend(range(offset, offset + state.rows))
        rows.images.append(state.control_images[slot].expand(state.rows, -1, -1, -1))
        rows.scales.extend([scale] * state.rows)
    return used


def _taken(cond: dict[str, Any], index: Tensor) -> dict[str, Any]:
    """`cond`'s rows at `index`, into nested dicts."""
    return {
        name: _taken(value, index) if isinstance(value, dict) else value[index]
        for name, value in cond.items()
    }


def _placed(own: Passed, index: Tensor, latents: Tensor, full: Passed | None = None) -> Passed:
    """`own` (residuals of the rows at `index`) put on those rows of `full`, a forward's
    residuals (zeros where None)."""
    own_down, own_mid = own
    if full is None:
        full = [_zeros(latents, sample) for sample in own_down], _zeros(latents, own_mid)
    for whole, sample in zip(full[0], own_down, strict=True):
        whole[index] = sample
    full[1][index] = own_mid
    return full


def _zeros(latents: Tensor, sample: Tensor) -> Tensor:
    return sample.new_zeros((latents.shape[0], *sample.shape[1:]))


def _add(a: Passed, b: Passed) -> Passed:
    return [x + y for x, y in zip(a[0], b[0], strict=True)], a[1] + b[1]


def controlnet_path(source: str) -> str:
    """Where `--controlnet`'s SOURCE is: an embedded tiny ControlNet's directory (built first
    if needed), else the source itself (a local directory or a hub id)."""
    return str(tiny_controlnet_dir(source)) if is_tiny_controlnet(source) else source


def _load_one(name: str, source: str, pipe: Any) -> Any:
    path = controlnet_path(source)
    # A union ControlNet's config names its class, or at least its control types (xinsir's
    # first configs were written for their own class).
    config = ControlNetModel.load_config(path)
    union = config.get("_class_name") == ControlNetUnionModel.__name__ or "num_control_type" in config
    if union and pipe.unet.config.addition_embed_type != "text_time":
        raise ValueError(f"controlnet {name}: {source} is a union ControlNet for SDXL, not this model")
    net = (ControlNetUnionModel if union else ControlNetModel).from_pretrained(path)
    unet = pipe.unet
    # An inpainting UNet reads 9 channels, its ControlNet the 4 latent ones. SDXL's reads the
    # UNet's size numbers too: a refiner's (aesthetic scores) are one fewer than the base's.
    own = {**unet.config, "in_channels": pipe.vae.config.latent_channels}
    keys = (
        "cross_attention_dim",
        "block_out_channels",
        "in_channels",
        "projection_class_embeddings_input_dim",
    )
    for key in keys:
        if tuple(np.atleast_1d(net.config[key])) != tuple(np.atleast_1d(own[key])):
            raise ValueError(
                f"controlnet {name}: {source} does not fit the model's UNet "
                f"({key} {net.config[key]} against the UNet's {own[key]})"
            )
    return net.to(device=unet.device, dtype=unet.dtype).eval()
