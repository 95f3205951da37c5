"""FLUX.1's ControlNets (`FluxControlNetModel`, InstantX's layout) served beside a FLUX.1
model (text-to-image, image-to-image, inpainting), batched step by step as
`pipelines.controlnet` batches the UNets'.

As `FluxControlNetPipeline` (and its img2img and inpainting twins): each control image is
resized and VAE-encoded with the request's generators before anything else is drawn (then
shifted, scaled and packed as the latents are), and at each step the ControlNet runs on the
request's positive rows, with their text, pooled text, timestep and (for a guidance-distilled
ControlNet) guidance; its block and single-block residuals, times the request's scale (0
outside its window), go to the transformer for both halves of a request with true CFG, since
the text-to-image pipeline reuses the positive pass's residuals for the negative one. A step
runs each ControlNet once per image size on the rows it steers (its blocks take no attention
mask, so rows of other sizes cannot share its forward); the residuals land on each row's own
places of the transformer's padded grid, and rows without control get zeros, which the
transformer adds without changing a bit. A request's k-th ControlNets add in order, as
`FluxMultiControlNetModel` sums them.

A union ControlNet (InstantX's Union: `num_mode` in its config) reads each row's control mode
as one more text token (`controlnet_mode`, one per row), so rows of different modes share its
forward; a request naming it twice with two modes gets two passes, summed, as diffusers'
multi-ControlNet call with the one union model does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import FluxControlNetModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.controlnet import Residuals, controlnet_path, slot_controls
from pipelines.outputs import resolved
from pipelines.stepping.padded_grid import PaddedGrid
from pipelines.stepping.setup import packed_size
from pipelines.stepping.state import Conditioning, DenoiseState

# The transformer's arguments for them.
_BLOCKS, _SINGLE_BLOCKS = "controlnet_block_samples", "controlnet_single_block_samples"


class FluxControlNets:
    """The FLUX ControlNets served beside one model, on its transformer's device and dtype."""

    fuses_union = False  # InstantX's union ControlNet reads one image per pass

    def __init__(self, nets: dict[str, Any], pipe: Any) -> None:
        self.nets = nets
        self.pipe = pipe

    @classmethod
    def load(cls, pipe: Any, sources: tuple[tuple[str, str], ...]) -> FluxControlNets:
        nets = {name: _load_one(name, source, pipe.transformer) for name, source in sources}
        # One forward adds one list of residuals per kind: every ControlNet must make as many.
        if len({(net.config.num_layers, net.config.num_single_layers) for net in nets.values()}) > 1:
            raise ValueError(
                "--controlnet: FLUX ControlNets served together must have the same numbers of "
                "double- and single-stream blocks"
            )
        return cls(nets, pipe)

    def modes(self) -> dict[str, int]:
        return {name: int(net.config.num_mode or 0) for name, net in self.nets.items()}

    def images(
        self, request: GenerationRequest, generators: list[torch.Generator], device: torch.device
    ) -> tuple[Tensor, ...]:
        """Each control image's packed latents, one row per image sampled with its generator, as
        `FluxControlNetPipeline` makes them (in the VAE's dtype)."""
        pipe, vae, n = self.pipe, self.pipe.vae, request.params.n
        width, height = resolved(request.params.width), resolved(request.params.height)
        images = []
        for control in request.controls:
            pixels = pipe.image_processor.preprocess(
                Image.fromarray(control.image), height=height, width=width
            )
            pixels = pixels.repeat_interleave(n, dim=0).to(device=device, dtype=vae.dtype)
            latents = retrieve_latents(vae.encode(pixels), generator=generators)
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
            images.append(pipe._pack_latents(latents, n, *latents.shape[1:]))
        return tuple(images)

    def residuals(
        self,
        states: list[DenoiseState],
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
        grid: PaddedGrid,
    ) -> Residuals | None:
        """The transformer's ControlNet arguments for a forward over `states`' rows (`latents`:
        each row's own tokens first; `timesteps` as the transformer takes them), on `grid`; None
        when no row is controlled at this step."""
        slots = max((len(state.request.controls) for state in states), default=0)
        total: tuple[list[Tensor], list[Tensor]] | None = None
        for slot in range(slots):
            groups = self._slot_groups(states, slot)
            if not groups:
                continue
            summed = self._slot(groups, latents, timesteps, cond, grid)
            total = summed if total is None else _add(total, summed)
        if total is None:
            return None
        return {_BLOCKS: total[0] or None, _SINGLE_BLOCKS: total[1] or None}

    def _slot_groups(self, states: list[DenoiseState], slot: int) -> dict[tuple[str, int, int], _Rows]:
        """The rows of each request's `slot`-th ControlNet, by (ControlNet, token grid)."""
        groups: dict[tuple[str, int, int], _Rows] = {}
        for state, offset, name, scale in slot_controls(states, slot):
            height, width = packed_size(self.pipe, state.request)
            rows = groups.setdefault((name, height // 2, width // 2), _Rows())
            images = state.num_images
            negative = state.rows - images  # its negative rows come first, as many as images
            for image in range(images):
                rows.source.append(offset + negative + image)
                rows.targets.append([offset + negative + image, *([offset + image] if negative else [])])
            rows.images.append(state.control_images[slot])
            rows.scales.extend([scale] * images)
            rows.guidance.extend([resolved(state.request.params.guidance_scale)] * images)
            rows.modes.extend([state.request.controls[slot].mode] * images)
        return groups

    def _slot(
        self,
        groups: dict[tuple[str, int, int], _Rows],
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
        grid: PaddedGrid,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One slot's residuals on the grid: each group's on its rows, zeros on the others."""
        full: tuple[list[Tensor], list[Tensor]] | None = None
        for (name, height, width), rows in groups.items():
            own = self._run(rows, name, (height, width), latents=latents, timesteps=timesteps, cond=cond)
            if full is None:
                full = (
                    _zeros(own[0], latents.shape[0], grid.tokens),
                    _zeros(own[1], latents.shape[0], grid.tokens),
                )
            targets = [target for row in rows.targets for target in row]
            sources = torch.tensor(
                [k for k, row in enumerate(rows.targets) for _ in row], device=latents.device
            )
            places = torch.stack([grid.places[target] for target in targets])
            index = torch.tensor(targets, device=latents.device)[:, None]
            for whole, samples in zip(full, own, strict=True):
                for target, sample in zip(whole, samples, strict=True):
                    target[index, places] = sample[sources]
        assert full is not None
        return full

    def _run(
        self,
        rows: _Rows,
        name: str,
        grid: tuple[int, int],
        *,
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """ControlNet `name` on `rows` (of token grid `grid`), its residuals times each row's scale."""
        pipe, net, device = self.pipe, self.nets[name], latents.device
        index = torch.tensor(rows.source, device=device)
        text = cond["encoder_hidden_states"][index]
        guidance = mode = None
        if net.config.guidance_embeds:  # as the pipeline: one per row, float32
            guidance = torch.tensor(rows.guidance, dtype=torch.float32, device=device)
        if net.union:  # admission saw that each row has one (`check_modes`)
            mode = torch.tensor(rows.modes, dtype=torch.long, device=device)[:, None]
        blocks, singles = net(
            hidden_states=latents[index, : grid[0] * grid[1]],
            controlnet_cond=torch.cat(rows.images),
            conditioning_scale=1.0,
            timestep=timesteps[index],
            guidance=guidance,
            controlnet_mode=mode,
            pooled_projections=cond["pooled_projections"][index],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=text.dtype),
            img_ids=pipe._prepare_latent_image_ids(len(rows.source), *grid, device, latents.dtype),
            return_dict=False,
        )
        # Per row, as the pipeline scales a whole call by its one float.
        scale = torch.tensor(rows.scales, dtype=torch.float32, device=device).view(-1, 1, 1)
        return (
            [(sample * scale).to(sample.dtype) for sample in blocks or ()],
            [(sample * scale).to(sample.dtype) for sample in singles or ()],
        )


@dataclass
class _Rows:
    """Rows of one forward that one ControlNet steers at this step, all of one image size:
    the positive rows it runs on, the rows each one's residuals go to (its request's negative
    row too, under true CFG), their control latents, scales, distilled guidance and (a union
    ControlNet's) modes."""

    source: list[int] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)
    images: list[Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    guidance: list[float] = field(default_factory=list)
    modes: list[int | None] = field(default_factory=list)


def _zeros(samples: list[Tensor], rows: int, tokens: int) -> list[Tensor]:
    return [sample.new_zeros(rows, tokens, sample.shape[2]) for sample in samples]


def _add(
    a: tuple[list[Tensor], list[Tensor]], b: tuple[list[Tensor], list[Tensor]]
) -> tuple[list[Tensor], list[Tensor]]:
    return [x + y for x, y in zip(a[0], b[0], strict=True)], [x + y for x, y in zip(a[1], b[1], strict=True)]


def _load_one(name: str, source: str, transformer: Any) -> Any:
    net = FluxControlNetModel.from_pretrained(controlnet_path(source), torch_dtype=transformer.dtype)
    if net.input_hint_block is not None:
        raise ValueError(f"controlnet {name}: {source} reads pixels (XLabs' layout): not served yet")
    own = transformer.config
    for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim"):
        if net.config[key] != own[key]:
            raise ValueError(
                f"controlnet {name}: {source} does not fit the model's transformer "
                f"({key} {net.config[key]} against the transformer's {own[key]})"
            )
    return net.to(transformer.device).eval()
