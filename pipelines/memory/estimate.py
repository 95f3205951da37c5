"""A model's weights' bytes before it loads, read from its files on disk: the safetensors
headers of the components its model index names (tensor shapes and stored dtypes), with
floating-point tensors counted in the dtype they will load in. `engine.models.model_set` uses it
so that a model's first load makes room ahead instead of overflowing the budget; once it
has loaded, the measured footprint (`footprint.weight_bytes`) replaces it.

Not counted: per-component dtypes and quantization (the estimate is the plain load), and
a hub model not in the local cache (None: its size is known once it loads)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

# Bytes per element of the safetensors dtypes.
_STORED = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_STORED_OTHER = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_LOADED = {"float32": 4, "float16": 2, "bfloat16": 2}


def estimated_weight_bytes(model: str, dtype: str, device: str) -> int | None:
    """Bytes of `model`'s weights once loaded in `dtype` ("auto": float32 on the CPU,
    bfloat16 elsewhere) on `device`; None when its files cannot be read here."""
    try:
        root = _local_dir(model)
        if root is None or not (root / "model_index.json").is_file():
            return None
        index = json.loads((root / "model_index.json").read_text())
        width = _LOADED.get(dtype, 4 if device == "cpu" else 2)
        total = 0
        for component, value in index.items():
            if component.startswith("_") or not isinstance(value, list) or value[0] is None:
                continue
            for file in _weight_files(root / component):
                total += _file_bytes(file, width)
        return total or None
    except (OSError, ValueError) as exc:
        logger.info("cannot estimate the size of %s before loading it: %s", model, exc)
        return None


def _local_dir(model: str) -> Path | None:
    from pipelines.loading import resolve_model_path  # the tiny and shipped models' directories

    path = Path(resolve_model_path(model))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached here (or not a hub id): unknown until it loads
        return None


def _weight_files(component: Path) -> list[Path]:
    """The safetensors files diffusers loads for a component: the plain ones (sharded or
    not), not a variant (`*.fp16.safetensors`) beside them."""
    files = sorted(component.glob("*.safetensors"))
    plain = [f for f in files if len(f.name.split(".")) == 2]
    return plain or files


def _file_bytes(file: Path, width: int) -> int:
    """A safetensors file's tensors' bytes, floating-point ones at `width` bytes an element."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in tensor["shape"]:
            count *= dim
        stored = tensor["dtype"]
        total += count * (width if stored in _STORED else _STORED_OTHER.get(stored, 4))
    return total
