"""Sequence parallelism (`--sequence-parallel N`, `--sp-mode ulysses|ring`): each forward's
tokens split between the N devices of a CFG share of a lane, with diffusers' own context
parallelism (`ContextParallelConfig`, the denoiser's `_cp_plan`, `enable_parallelism`).

The plan's hooks cut the denoiser's inputs along the sequence on entry (the image tokens,
the text tokens and their positions, each into N equal parts), the attention exchanges what
it needs (Ulysses: an all-to-all from token shards to head shards and back; ring: every
device's keys and values, merged by their log-sum-exp: on the CPU with the op of
`pipelines.parallel.ring_cpu`), and the output is gathered on exit:
every device gets the whole prediction of the rows it ran, so the stepping above it does not
change (`pipelines.parallel.lane_split`).

What it takes, checked at start (`refusal`, naming `--sequence-parallel`) or per request
(`pipelines.admission`, a 400 naming `size`): a family that says its forward fits the plan
(`Family.splits_tokens`; a denoiser without `_cp_plan`, every UNet, is refused with that
reason), heads divisible by the Ulysses degree, for ring a plan that cuts no attention mask
(diffusers 0.42.1 gathers a cut mask for Ulysses only: its ring would hide every device's
keys by this device's share), and every sequence the plan cuts divisible by N (diffusers'
equal shards). A family that pads rows of different sizes to one grid
steps one size at a time here: its padding mask is laid out for the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from pipelines.cache.block_hooks import denoiser_blocks
from pipelines.parallel import ring_cpu
from pipelines.parallel.seat import LaneSeat, LaneShape

FLAG = "--sequence-parallel"


def denoiser_of(pipeline: Any) -> Any:
    """The module whose forward the tokens are split in: the transformer, else the UNet."""
    pipe = pipeline.family.pipe
    transformer = getattr(pipe, "transformer", None)
    return transformer if transformer is not None else getattr(pipe, "unet", None)


def denoisers_of(pipeline: Any) -> list[Any]:
    """Every denoiser a step may run: the transformer, and Wan 2.2 A14B's low-noise expert
    (`transformer_2`) beside it, each with the plan on."""
    second = getattr(pipeline.family.pipe, "transformer_2", None)
    return [denoiser_of(pipeline)] + ([second] if second is not None else [])


def refusal(pipeline: Any, shape: LaneShape) -> str | None:
    """Why `pipeline` cannot split its tokens over `shape.sequence` devices, or None."""
    family = getattr(pipeline, "family", None)
    if family is None or not hasattr(pipeline, "row_split"):
        return f"{type(pipeline).__name__} is not a diffusers family adapter; only those split their steps"
    name = type(family).__name__
    if not pipeline.supports_step_batch:
        return f"{name} does not run step by step here, and sequence parallelism splits each step"
    denoiser = denoiser_of(pipeline)
    module = type(denoiser).__name__
    if getattr(denoiser, "_cp_plan", None) is None:
        return f"{module} has no context-parallel plan (_cp_plan) in diffusers 0.42.1"
    if not vars(type(family)).get("splits_tokens", False):
        return (
            f"{name} does not split its tokens between devices yet "
            "(FLUX.1, FLUX.2, Qwen-Image, Wan and LTX do)"
        )
    heads = int(getattr(denoiser.config, "num_attention_heads", 0))
    if shape.mode == "ulysses" and heads % shape.sequence:
        return (
            f"Ulysses gives each device a share of the attention heads: {module} has {heads}, "
            f"not a multiple of {shape.sequence} (--sp-mode ring splits no heads)"
        )
    return _ring_refusal(denoiser) if shape.mode == "ring" else None


def _ring_refusal(denoiser: Any) -> str | None:
    """Why ring attention would not be exact for `denoiser`: an attention mask among the
    inputs its plan cuts along the sequence (Qwen-Image's text mask, LTX's)."""
    masks = [
        name
        for inputs in denoiser._cp_plan.values()
        if isinstance(inputs, dict)
        for name in inputs
        if isinstance(name, str) and "mask" in name
    ]
    if not masks:
        return None
    return (
        f"ring attention cannot take {type(denoiser).__name__}'s {masks[0]}: the plan cuts it with "
        "the tokens, and diffusers 0.42.1's ring hides every device's keys by this device's share "
        "of it (its Ulysses gathers the whole mask); use --sp-mode ulysses"
    )


def first_block_refusal(denoisers: Sequence[torch.nn.Module]) -> str | None:
    """Why First-Block Cache cannot run while a lane splits these denoisers' tokens, or None.
    It measures its first block's change (output - input) on each device's share of the
    tokens, and keeps each share's residuals where it was computed: that takes a plan that
    cuts the tokens before the blocks (FLUX.1's, FLUX.2's and LTX's cut the transformer's
    inputs). A plan that cuts them at the first block's own entry (Qwen-Image's, Wan's) cuts
    inside the cache's hook on that block: it would see the whole input and a share of the
    output."""
    for denoiser in denoisers:
        plan = getattr(denoiser, "_cp_plan", None) or {}
        blocks = denoiser_blocks(denoiser)
        head = {name for name, module in denoiser.named_modules() if blocks and module is blocks[0]}
        if head & set(plan):
            return (
                f"{type(denoiser).__name__}'s context-parallel plan cuts its tokens at its first "
                "block's entry, where First-Block Cache measures that block's change"
            )
    return None


def split_tokens(pipeline: Any, seat: LaneSeat, device: str) -> tuple[Any, Any]:
    """Put diffusers' context-parallel hooks on the denoiser for `seat`'s lane (the process
    group is up); the group that joins the two CFG shares of this member's sequence rank and
    the group of the members that split its share's tokens, each None where it is the whole
    lane (without a CFG split: no first, and the second is the lane)."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    shape = seat.shape
    ring, ulysses = (shape.sequence, 1) if shape.mode == "ring" else (1, shape.sequence)
    device_type = torch.device(device).type
    mesh = init_device_mesh(
        device_type, (shape.cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses")
    )
    for denoiser in denoisers_of(pipeline):
        config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=mesh["ring", "ulysses"])
        _resolve_on(denoiser, seat, torch.device(device))
        denoiser.enable_parallelism(config=config)
        if type(denoiser).__name__ == "LTXVideoTransformer3DModel":
            _one_mask_for_all_heads()
    if ring > 1 and device_type == "cpu":
        ring_cpu.install()
    if shape.cfg == 1:
        return None, None
    return mesh["cfg"].get_group(), mesh["ring" if ring > 1 else "ulysses"].get_group()


def _resolve_on(denoiser: Any, seat: LaneSeat, device: torch.device) -> None:
    """Have `enable_parallelism` set its config up on this member's own device and mesh.
    diffusers 0.42.1 derives the device from the accelerator (`rank % device_count`): a
    ZeroDivisionError in a CPU build of torch, and `cuda:rank` where this lane's devices are
    others (a second data-parallel lane); the rest of its `_resolve_parallel_config` is this."""
    from diffusers.models._modeling_parallel import ParallelConfig

    def resolve(config: Any) -> Any:
        resolved = ParallelConfig(context_parallel_config=config)
        resolved.setup(seat.rank, seat.size, device, mesh=config.mesh)
        denoiser._parallel_config = resolved
        return resolved

    denoiser._resolve_parallel_config = resolve


def _one_mask_for_all_heads() -> None:
    """LTX's attention processor repeats the text's padding mask for every head, (B, heads,
    1, L), before diffusers' Ulysses all-to-all leaves each device a share of the heads:
    the mask then has more heads than the attention (diffusers 0.42.1 raises a size
    mismatch). Every head's mask is the same row, so the first one, broadcast, is exact.
    Only in a lane's member (this process splits tokens for its life)."""
    from diffusers.models.transformers import transformer_ltx

    dispatch = transformer_ltx.dispatch_attention_fn
    if getattr(dispatch, "one_mask_for_all_heads", False):
        return

    def dispatched(*args: Any, attn_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if attn_mask is not None and attn_mask.dim() == 4 and kwargs.get("parallel_config") is not None:
            attn_mask = attn_mask[:, :1]
        return dispatch(*args, attn_mask=attn_mask, **kwargs)

    dispatched.one_mask_for_all_heads = True  # type: ignore[attr-defined]
    transformer_ltx.dispatch_attention_fn = dispatched


@contextmanager
def detached(pipeline: Any) -> Iterator[None]:
    """The denoisers without their context-parallel hooks inside (the profile run at start:
    each member runs its own dummy requests, whole), as they were after."""
    with ExitStack() as stack:
        for denoiser in denoisers_of(pipeline):
            stack.enter_context(_detached(denoiser))
        yield


@contextmanager
def _detached(denoiser: Any) -> Iterator[None]:
    from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

    config = getattr(denoiser, "_parallel_config", None)
    if config is None:
        yield
        return
    plan = denoiser._cp_plan
    processors = [p for p in _processors(denoiser) if getattr(p, "_parallel_config", None) is not None]
    remove_context_parallel(denoiser, plan)
    for processor in processors:
        processor._parallel_config = None
    try:
        yield
    finally:
        for processor in processors:
            processor._parallel_config = config
        apply_context_parallel(denoiser, config.context_parallel_config, plan)


def _processors(denoiser: torch.nn.Module) -> list[Any]:
    return [
        module.processor for module in denoiser.modules() if getattr(module, "processor", None) is not None
    ]
