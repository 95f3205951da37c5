"""SDXL's union ControlNet (diffusers' `ControlNetUnionModel`: xinsir's controlnet-union-sdxl-1.0
and its ProMax) in a shared step: one pass per request fuses all of its control images.

Unlike FLUX.1's union ControlNet, which reads one image per pass and sums the passes, SDXL's
reads a request's images together: each image's features, tagged with its control type (the
request's `mode`), go through a small fusion transformer and are summed into the latents'
features before the ControlNet's blocks, and the types a request uses are set in a per-row
`control_type` vector that joins the time embedding. So a request that names the union
ControlNet in several entries gets one pass, as `StableDiffusionXLControlNetUnionPipeline`
makes it, and cannot mix it with other ControlNets (admission refuses that: diffusers has no
pipeline that does).

The scales follow diffusers' forward. With one image, the pass runs unscaled and its residuals
are scaled per row afterwards (as any ControlNet's), so rows of any scale share it (of one mode:
the forward takes one list of modes per call), and a row outside its window gets zeros. With
several, each image's scale at this step (its entry's `scale`, 0 outside its window: the
pipeline's `controlnet_keep`) weighs that image inside the fusion and the residuals are not
scaled; an image at scale 0 still takes its place in the fusion, and the ControlNet still
steers the row when every image is outside its window. Those scales are one list per call in
diffusers' forward, so such rows share a pass only where their modes and their scales at this
step are the same: each such group is one more ControlNet pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipelines.stepping.state import DenoiseState

# What one pass adds: the down residuals and the mid residual.
Passed = tuple[list[Tensor], Tensor]


@dataclass
class FusedRows:
    """Rows of one forward that share one union pass: the rows (both halves of a guided
    request), each image slot's control images (one tensor per request), and, for one image,
    each row's scale at this step."""

    modes: tuple[int, ...]
    scales: tuple[float, ...] | None  # several images: their scales inside the pass
    index: list[int] = field(default_factory=list)
    images: list[list[Tensor]] = field(default_factory=list)
    row_scales: list[float] = field(default_factory=list)


def fused_rows(states: list[DenoiseState], unions: set[str]) -> dict[tuple[Any, ...], FusedRows]:
    """The union passes of a forward over `states`' rows (laid out as the step lays them:
    each request's `state.rows` in turn), by (ControlNet, modes, inside scales), for the
    requests whose ControlNet is one of `unions` (admission saw it is their only one)."""
    groups: dict[tuple[Any, ...], FusedRows] = {}
    offset = 0
    for state in states:
        controls = state.request.controls
        if controls and controls[0].name in unions:
            scales = tuple(control.keep(state.steps_done, state.total_steps) for control in controls)
            modes = tuple(control.mode or 0 for control in controls)
            single = len(controls) == 1
            if not single or scales[0] != 0.0:  # one image outside its window: zeros
                key = (controls[0].name, modes, None if single else scales)
                rows = groups.get(key)
                if rows is None:
                    rows = groups[key] = FusedRows(modes, None if single else scales)
                    rows.images = [[] for _ in controls]
                rows.index.extend(range(offset, offset + state.rows))
                for slot, image in zip(rows.images, state.control_images, strict=True):
                    slot.append(image.expand(state.rows, -1, -1, -1))
                rows.row_scales.extend([scales[0]] * state.rows)
        offset += state.rows
    return groups


def run_fused(net: Any, rows: FusedRows, latents: Tensor, timesteps: Tensor, cond: dict[str, Any]) -> Passed:
    """The union ControlNet `net` on `rows` (`latents`, `timesteps` and `cond` already taken
    at their index), as `StableDiffusionXLControlNetUnionPipeline`'s step calls it."""
    text = cond["encoder_hidden_states"]
    # One row per row, the request's types set; in the text's dtype, as the pipeline casts it.
    control_type = torch.zeros(len(rows.index), net.config.num_control_type, device=text.device)
    control_type[:, list(rows.modes)] = 1.0
    down, mid = net(
        latents,
        timesteps,
        controlnet_cond=[torch.cat(images) for images in rows.images],
        control_type=control_type.to(text.dtype),
        control_type_idx=list(rows.modes),
        conditioning_scale=[1.0] if rows.scales is None else list(rows.scales),
        return_dict=False,
        **cond,
    )
    if rows.scales is not None:  # scaled inside the fusion
        return list(down), mid
    # One image: per row, as diffusers scales a whole call by its one float.
    scale = torch.tensor(rows.row_scales, dtype=torch.float32, device=latents.device).view(-1, 1, 1, 1)
    return [(sample * scale).to(sample.dtype) for sample in down], (mid * scale).to(mid.dtype)
