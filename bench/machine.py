"""Facts every benchmark output states: the machine, the software, and what the model makes."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def describe_machine(threads: int | None) -> dict[str, object]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# The modalities served at `/v1/videos`; image-to-video's requests each bring an `input_reference`.
VIDEO_MODALITIES = ("video", "image-to-video")


def detect_modality(model: str, pipeline_class: str | None = None) -> str:
    """image, edit, video or image-to-video: which endpoint the model is served at, and
    whether a video request needs an input image there (from its adapter class)."""
    from pipelines.loading import diffusers_class_name, resolve_model_path
    from pipelines.registry import adapter_for_model, import_pipeline_class

    if pipeline_class:
        adapter = import_pipeline_class(pipeline_class)
    else:
        adapter = adapter_for_model(diffusers_class_name(resolve_model_path(model)))
    if adapter.modality == "video" and adapter.input_image_count[0] > 0:
        return "image-to-video"
    # A model served at both image endpoints (FLUX.2: references optional) is timed on
    # text-to-image, the endpoint every request can use.
    return "image" if adapter.modality == "image+edit" else str(adapter.modality)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
