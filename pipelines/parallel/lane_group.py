"""Joining a lane of several devices: a worker that loaded its pipeline checks that the lane
can split it, then meets the lane's other workers as one `torch.distributed` group (NCCL on
CUDA devices, gloo elsewhere), puts diffusers' context-parallel hooks on its denoiser where
the lane splits tokens (`pipelines.parallel.sequence`), and gives the pipeline its share of
each step (`pipelines.parallel.lane_split`).

A refusal names `--cfg-parallel` or `--sequence-parallel` (`LaneRefusedError.flag`), so the
server ends at start with that one line; it comes before the rendezvous, so no member waits
for one that refused.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipelines.parallel import sequence
from pipelines.parallel.lane_split import LaneSplit
from pipelines.parallel.seat import LaneSeat

logger = logging.getLogger(__name__)

FLAG = "--cfg-parallel"
# How long a collective may wait for the other members (the rendezvous at start included:
# it covers one member loading slower than the other). A member that dies is noticed by its
# supervisor at once (`engine.executor.lane_group`); this bounds a member that hangs.
GROUP_TIMEOUT_S = 300.0


class LaneRefusedError(ValueError):
    """A pipeline a lane of several devices cannot split; the message starts with the flag."""

    def __init__(self, message: str, flag: str = FLAG) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def backend_for(device: str) -> str:
    """NCCL between CUDA devices, gloo on the CPU (and wherever NCCL is not)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def refusal(pipeline: Any) -> str | None:
    """Why `pipeline` cannot share its guided rows between two devices, or None."""
    family = getattr(pipeline, "family", None)
    if family is None or not hasattr(pipeline, "row_split"):
        return f"{type(pipeline).__name__} is not a diffusers family adapter; only those split their steps"
    name = type(family).__name__
    if not pipeline.supports_step_batch:
        return f"{name} does not run step by step here, and CFG-parallel splits each step"
    if family.no_cfg is not None:
        return f"{family.no_cfg}: it has no negative rows to run on a second device"
    if not vars(type(family)).get("splits_cfg", False):
        return f"{name} does not split its guided rows between devices yet (Stable Diffusion and FLUX do)"
    controlnets = getattr(getattr(pipeline, "config", None), "controlnets", ())
    if controlnets and not vars(type(family)).get("splits_cfg_with_controlnet", False):
        return (
            f"{name} does not split its ControlNets' rows between devices yet (Stable Diffusion "
            "does; FLUX reuses its positive rows' residuals for the negative rows, which the "
            "lane's other device runs)"
        )
    return None


def check(pipeline: Any, seat: LaneSeat) -> None:
    """Refuse a pipeline the lane cannot split, naming the flag that asked for the split."""
    reason = refusal(pipeline) if seat.shape.cfg > 1 else None
    if reason is not None:
        raise LaneRefusedError(reason)
    reason = sequence.refusal(pipeline, seat.shape) if seat.shape.sequence > 1 else None
    if reason is not None:
        raise LaneRefusedError(reason, sequence.FLAG)


def join_lane(pipeline: Any, seat: LaneSeat, device: str) -> None:
    """Refuse a pipeline the lane cannot split, else meet the others and give it its share."""
    check(pipeline, seat)
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://{seat.address}",
        rank=seat.rank,
        world_size=seat.size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    split = seat.shape.sequence > 1
    cfg_group, token_group = sequence.split_tokens(pipeline, seat, device) if split else (None, None)
    logger.info(
        "worker process %d joined a lane of %d devices as member %d (%s, %s; %s)",
        os.getpid(),
        seat.size,
        seat.rank,
        backend,
        seat.address,
        _described(seat),
    )
    pipeline.row_split = LaneSplit(seat, cfg_group, token_group)


def _described(seat: LaneSeat) -> str:
    shape = seat.shape
    parts = [f"cfg share {seat.cfg_rank} of {shape.cfg}"] if shape.cfg > 1 else []
    if shape.sequence > 1:
        parts.append(f"{shape.mode} tokens {seat.rank % shape.sequence} of {shape.sequence}")
    return ", ".join(parts)


@contextmanager
def alone(pipeline: Any) -> Iterator[None]:
    """Steps inside run every row and every token on this device, without the lane (the
    profile run at start)."""
    split, pipeline.row_split = pipeline.row_split, None
    try:
        with sequence.detached(pipeline):
            yield
    finally:
        pipeline.row_split = split
