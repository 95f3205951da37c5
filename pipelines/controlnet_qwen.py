"""Qwen-Image's ControlNets (`QwenImageControlNetModel`, InstantX's layout) served beside a
Qwen-Image text-to-image model, batched step by step as `pipelines.controlnet` batches the
UNets'.

As `QwenImageControlNetPipeline`: each control image is resized, VAE-encoded with the
request's generators before anything else is drawn (one frame of the video VAE, normalised by
the VAE's latent mean and std, then packed as the latents are), and at each step the
ControlNet runs on the request's positive rows, with their text and mask and the timestep /
1000; its block residuals, times the request's scale (0 outside its window), go to the
transformer for both halves of a request with true CFG, since the pipeline reuses the positive
pass's residuals for the negative one. A Qwen-Image step group shares its image size, so each
ControlNet runs once per step on every row it steers, whatever their prompts' lengths (the
text is padded with a mask, which its blocks honour as the transformer's do); rows without
control get zeros, which the transformer adds without changing a bit.

InstantX's Union model takes no mode: one model reads canny, soft edge, depth and pose images
alike. diffusers' `QwenImageMultiControlNetModel` runs that one model once per control image
and sums the residuals, which is what a request naming it twice gets here; a request may also
name two different ControlNets (their residuals sum the same way), which diffusers' multi
model refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import QwenImageControlNetModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.controlnet import Residuals, controlnet_path, slot_controls
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning, DenoiseState

# The transformer's argument for them.
_BLOCKS = "controlnet_block_samples"
_TEXT, _MASK = "encoder_hidden_states", "encoder_hidden_states_mask"


class QwenImageControlNets:
    """The Qwen-Image ControlNets served beside one model, on its transformer's device and dtype."""

    fuses_union = False  # InstantX's union ControlNet reads one image per pass, no mode

    def __init__(self, nets: dict[str, Any], pipe: Any) -> None:
        self.nets = nets
        self.pipe = pipe

    @classmethod
    def load(cls, pipe: Any, sources: tuple[tuple[str, str], ...]) -> QwenImageControlNets:
        nets = {name: _load_one(name, source, pipe.transformer) for name, source in sources}
        # The transformer spreads one list of residuals over its blocks by the list's length:
        # residuals of ControlNets of other depths could not be summed.
        if len({net.config.num_layers for net in nets.values()}) > 1:
            raise ValueError("--controlnet: Qwen-Image ControlNets served together must have as many blocks")
        return cls(nets, pipe)

    def modes(self) -> dict[str, int]:
        return dict.fromkeys(self.nets, 0)  # a Union model reads its image's kind from the image

    def images(
        self, request: GenerationRequest, generators: list[torch.Generator], device: torch.device
    ) -> tuple[Tensor, ...]:
        """Each control image's packed latents, one row per image sampled with its generator, as
        `QwenImageControlNetPipeline` makes them (in the text's dtype, as the pipeline casts
        them to its prompt embeddings')."""
        pipe, vae, n = self.pipe, self.pipe.vae, request.params.n
        width, height = resolved(request.params.width), resolved(request.params.height)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(device)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device)
        images = []
        for control in request.controls:
            pixels = pipe.image_processor.preprocess(
                Image.fromarray(control.image), height=height, width=width
            )
            pixels = pixels.repeat_interleave(n, dim=0).to(device=device, dtype=vae.dtype).unsqueeze(2)
            latents = retrieve_latents(vae.encode(pixels), generator=generators)
            latents = ((latents - mean) * inverse_std).permute(0, 2, 1, 3, 4)
            packed = pipe._pack_latents(latents, n, latents.shape[2], *latents.shape[3:])
            images.append(packed.to(device=device, dtype=pipe.text_encoder.dtype))
        return tuple(images)

    def residuals(
        self, states: list[DenoiseState], latents: Tensor, timesteps: Tensor, cond: Conditioning
    ) -> Residuals | None:
        """The transformer's ControlNet argument for a forward over `states`' rows (one image
        size; `timesteps` as the transformer takes them); None when no row is controlled at
        this step."""
        slots = max((len(state.request.controls) for state in states), default=0)
        total: list[Tensor] | None = None
        for slot in range(slots):
            used = _slot_rows(states, slot)
            if not used:
                continue
            summed = self._slot(used, states, latents, timesteps, cond)
            total = summed if total is None else [x + y for x, y in zip(total, summed, strict=True)]
        return None if total is None else {_BLOCKS: total}

    def _slot(
        self,
        used: dict[str, _Rows],
        states: list[DenoiseState],
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
    ) -> list[Tensor]:
        """One slot's residuals: each ControlNet's on its rows, zeros on the others."""
        full: list[Tensor] | None = None
        for name, rows in used.items():
            own = self._run(rows, name, states[0].request, latents=latents, timesteps=timesteps, cond=cond)
            if full is None:
                full = [sample.new_zeros(latents.shape[0], *sample.shape[1:]) for sample in own]
            sources = torch.tensor(
                [k for k, row in enumerate(rows.targets) for _ in row], device=latents.device
            )
            targets = torch.tensor([target for row in rows.targets for target in row], device=latents.device)
            for whole, sample in zip(full, own, strict=True):
                whole[targets] = sample[sources]
        assert full is not None
        return full

    def _run(
        self,
        rows: _Rows,
        name: str,
        request: GenerationRequest,
        *,
        latents: Tensor,
        timesteps: Tensor,
        cond: Conditioning,
    ) -> list[Tensor]:
        """ControlNet `name` on `rows`, its residuals times each row's scale."""
        index = torch.tensor(rows.source, device=latents.device)
        side = self.pipe.vae_scale_factor * 2
        shape = (1, resolved(request.params.height) // side, resolved(request.params.width) // side)
        samples = self.nets[name](
            hidden_states=latents[index],
            controlnet_cond=torch.cat(rows.images),
            conditioning_scale=1.0,
            encoder_hidden_states=cond[_TEXT][index],
            encoder_hidden_states_mask=cond[_MASK][index],
            timestep=timesteps[index],
            img_shapes=[shape] * len(rows.source),
            return_dict=False,
        )
        # Per row, as the pipeline scales a whole call by its one float.
        scale = torch.tensor(rows.scales, dtype=torch.float32, device=latents.device).view(-1, 1, 1)
        return [(sample * scale).to(sample.dtype) for sample in samples]


@dataclass
class _Rows:
    """Rows of one forward that one ControlNet steers at this step: the positive rows it runs
    on, the rows each one's residuals go to (its request's negative row too, under true CFG),
    their control latents and scales."""

    source: list[int] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)
    images: list[Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


def _slot_rows(states: list[DenoiseState], slot: int) -> dict[str, _Rows]:
    """For each ControlNet that some request uses as its `slot`-th and that steers it at its
    step: its rows, control latents and scales."""
    used: dict[str, _Rows] = {}
    for state, offset, name, scale in slot_controls(states, slot):
        rows = used.setdefault(name, _Rows())
        images = state.num_images
        negative = state.rows - images  # its negative rows come first, as many as images
        for image in range(images):
            rows.source.append(offset + negative + image)
            rows.targets.append([offset + negative + image, *([offset + image] if negative else [])])
        rows.images.append(state.control_images[slot])
        rows.scales.extend([scale] * images)
    return used


def _load_one(name: str, source: str, transformer: Any) -> Any:
    net = QwenImageControlNetModel.from_pretrained(controlnet_path(source), torch_dtype=transformer.dtype)
    if net.config.extra_condition_channels:
        raise ValueError(
            f"controlnet {name}: {source} is an inpainting ControlNet (it reads a masked image and "
            "its mask, QwenImageControlNetInpaintPipeline): not served"
        )
    own = transformer.config
    # Its residuals add to the transformer's image tokens: the same width, as `width` says.
    sizes = {
        "in_channels": (net.config.in_channels, own.in_channels),
        "joint_attention_dim": (net.config.joint_attention_dim, own.joint_attention_dim),
        "width": (net.inner_dim, own.num_attention_heads * own.attention_head_dim),
    }
    for key, (theirs, ours) in sizes.items():
        if theirs != ours:
            raise ValueError(
                f"controlnet {name}: {source} does not fit the model's transformer "
                f"({key} {theirs} against the transformer's {ours})"
            )
    return net.to(transformer.device).eval()
