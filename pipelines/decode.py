"""A VAE decode that survives running out of memory: it decodes the same latents again in
halves, instead of losing them.

Decoding is the memory peak of a diffusion forward (a 1024² image's last VAE blocks hold
full-resolution activations per image), and in request-level batching it comes at the very
end: without this, an out-of-memory decode failed the whole forward, and the engine's
isolation (`engine.forward`) bisected the batch and ran the denoising loop again for each
half. Every diffusers pipeline ends with `self.vae.decode(latents, ...)`, so wrapping that
one method when the adapter is built covers every family, in both batching modes (the
stepping stages' decodes and VAE previews call it too), without taking the stock
`__call__` apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    """Accelerator or host memory ran out (the same test as `engine.forward`'s)."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError)


class HalvingDecode:
    """`decode(latents, *args, **kwargs)` that, when it runs out of memory on more than one
    image, decodes each half of the batch (recursively) and joins the outputs. Arguments
    with one entry per image (LTX's decode timesteps, a list of generators) are split with
    the latents. After a decode of k images ran out of memory, later decodes of k or more
    are cut up front: memory does not grow back on its own, and a failed attempt can cost
    nearly a whole decode."""

    def __init__(self, decode: Callable[..., Any]) -> None:
        self._decode = decode
        # Images in the smallest decode that ran out of memory; None until one has.
        self.too_many: int | None = None

    def __call__(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        size = int(latents.shape[0])
        if size > 1 and self.too_many is not None and size >= self.too_many:
            return self._halves(latents, args, kwargs)
        try:
            return self._decode(latents, *args, **kwargs)
        except Exception as exc:
            if size == 1 or not is_out_of_memory(exc):
                raise
            logger.warning("decoding %d images ran out of memory (%s); decoding them in halves", size, exc)
        # Out of the `except` block: the failed attempt's frames (and the activations they
        # hold) are freed before the halves run.
        self.too_many = size if self.too_many is None else min(self.too_many, size)
        return self._halves(latents, args, kwargs)

    def _halves(self, latents: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        size = int(latents.shape[0])
        middle = size // 2
        parts = []
        for part in (slice(0, middle), slice(middle, size)):
            part_args = [_part(value, size, part) for value in args]
            part_kwargs = {name: _part(value, size, part) for name, value in kwargs.items()}
            parts.append(self(latents[part], *part_args, **part_kwargs))
        return _join(parts[0], parts[1])


def _part(value: Any, size: int, part: slice) -> Any:
    """`value`'s entries for the images in `part`, if it has one entry per image."""
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == size:
        return value[part]
    if isinstance(value, list | tuple) and len(value) == size:
        return value[part]
    return value


def _join(first: Any, second: Any) -> Any:
    """Two decode outputs as one: tensors concatenated along the batch; tuples and diffusers'
    `DecoderOutput` (a dict-like dataclass) field by field."""
    if isinstance(first, torch.Tensor):
        return torch.cat([first, second])
    if isinstance(first, tuple):
        return tuple(_join(a, b) for a, b in zip(first, second, strict=True))
    if isinstance(first, dict):
        return type(first)(**{name: _join(value, second[name]) for name, value in first.items()})
    return first


def decode_in_halves(vae: Any) -> None:
    """Make `vae.decode` a `HalvingDecode` (once: an adapter built twice over one pipeline
    keeps the first)."""
    decode = getattr(vae, "decode", None)
    if decode is None or isinstance(decode, HalvingDecode):
        return
    vae.decode = HalvingDecode(decode)
