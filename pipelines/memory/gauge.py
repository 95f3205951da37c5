"""The real device behind `engine.worker.profile_run.MemoryGauge`: torch lives in the pipelines
layer, so the engine's profile search stays torch-free (tests/test_layering.py)."""

from __future__ import annotations

import gc
from typing import Any


class CudaGauge:
    """One CUDA device's memory, as its caching allocator holds it: reserved, not allocated
    (the cache is what other processes on the device cannot have)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)

    def capacity(self) -> int:
        return int(self.torch.cuda.get_device_properties(self.device).total_memory)

    def reset_peak(self) -> None:
        self.torch.cuda.synchronize(self.device)
        # The cache still holds what the last run (perhaps one that ran out) reserved: the
        # next run's reserved peak would start from it, and every smaller budget would read
        # as not fitting. Freed first, the peak starts from what is live (the weights).
        gc.collect()
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.torch.cuda.synchronize(self.device)  # work still queued has not allocated yet
        return int(self.torch.cuda.max_memory_reserved(self.device))


def device_total_bytes(device: str) -> int | None:
    """The total memory of a CUDA `device` ("cuda", "cuda:1"), None for any other or when no
    CUDA device is there (the default memory budget of several models is a share of it)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
