"""A test-only memory gauge for the profile run on the CPU (which has no device memory to
read): it reports a peak proportional to the rows the pipeline's components were called
with since `reset_peak` — the denoiser's and text encoder's rows at `ROW_MIB` each, a VAE
decode's images at `IMAGE_MIB` each — on a device of `CAPACITY_MIB`. Module-level and
picklable: a worker process builds it too (`ProfilePlan.gauge`)."""

from __future__ import annotations

from typing import Any

import torch

MIB = 2**20
CAPACITY_MIB = 100
ROW_MIB = 10
IMAGE_MIB = 30


class RowsGauge:
    def __init__(self, pipeline: Any) -> None:
        self.high = 0
        pipe = pipeline.pipe
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module) and name != "vae":
                component.register_forward_pre_hook(self._hook(ROW_MIB))
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        if isinstance(decoder, torch.nn.Module):
            decoder.register_forward_pre_hook(self._hook(IMAGE_MIB))

    def _hook(self, mib_per_row: int) -> Any:
        def observe(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            rows = next((int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.ndim), 0)
            self.high = max(self.high, rows * mib_per_row * MIB)

        return observe

    def capacity(self) -> int:
        return CAPACITY_MIB * MIB

    def reset_peak(self) -> None:
        self.high = 0

    def peak(self) -> int:
        if self.high > self.capacity():
            raise torch.OutOfMemoryError("fake: more than the device holds")
        return self.high
