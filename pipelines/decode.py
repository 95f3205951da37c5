"""A VAE decode that survives running out of memory: it decodes the same latents again in
halves, instead of losing them.

Decoding is the memory peak of a diffusion forward (a 1024² image's last VAE blocks hold
full-resolution activations per image), and in request-level batching it comes at the very
end: without this, an out-of-memory decode failed the whole forward, and the engine's
isolation (`engine.worker.forward`) bisected the batch and ran the denoising loop again for each
half. Every diffusers pipeline ends with `self.vae.decode(latents, ...)`, so wrapping that
one method when the adapter is built covers every family, in both batching modes (the
stepping stages' decodes and VAE previews call it too), without taking the stock
`__call__` apart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

# Decodes at a learnt cap that must fit before it rises by one image: the same patience
# as the engine's learnt limits (`engine.sched.step_budget.RAISE_AFTER_FITS`, the scheduler's
# `RAISE_CAP_AFTER`; a test keeps them equal, as pipelines import no engine internals).
RAISE_AFTER_FITS = 20


def is_out_of_memory(exc: BaseException) -> bool:
    """Accelerator or host memory ran out (the same test as `engine.worker.forward`'s)."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError)


class DecodeLimit(Protocol):
    """A configured bound on one decode (`pipelines.memory.decode_budget.DecodeBudget`)."""

    def images(self, latents: torch.Tensor) -> int:
        """Most images (videos) of `latents`' size one decode may hold; at least 1."""

    def tiled(self, latents: torch.Tensor) -> AbstractContextManager[None]:
        """Around a decode of `latents`: the VAE's tiled decode where one image alone is
        above the bound, nothing otherwise."""


class HalvingDecode:
    """`decode(latents, *args, **kwargs)` that, when it runs out of memory on more than one
    image, decodes each half of the batch (recursively) and joins the outputs. Arguments
    with one entry per image (LTX's decode timesteps, a list of generators) are split with
    the latents.

    It learns per image size (the latents' shape less the batch: a decode's memory grows
    with images x elements): after a decode of k images of one size ran out of memory,
    later decodes of k or more of that size are cut up front (a failed attempt can cost
    nearly a whole decode), and after `RAISE_AFTER_FITS` decodes at that cap fit it rises by
    one image, as the engine's learnt caps do (memory may have been short only for a while:
    another process, a step running beside the decode). `out_of_memory` counts the decodes
    that ran out (the engine reads it through the adapter for `/metrics`).

    With a `limit` (`--decode-budget`), a decode of more images than it allows is cut up
    front into chunks it allows, decoded one after the other: the configured bound is the
    starting cap, and what is learnt from running out of memory only lowers it (a rise stops
    at the configured bound)."""

    def __init__(self, decode: Callable[..., Any], limit: DecodeLimit | None = None) -> None:
        self.inner = decode  # the VAE's own decode
        self.limit = limit
        # Per image size: images in the smallest decode that ran out of memory, and the
        # decodes at that cap that fitted since.
        self._too_many: dict[tuple[int, ...], int] = {}
        self._fits_at_cap: dict[tuple[int, ...], int] = {}
        self.out_of_memory = 0
        # Decodes beside the steps and previews may run on two threads at once.
        self._lock = threading.Lock()

    def __call__(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        images = tuple(int(n) for n in latents.shape[1:])
        ran_out = self.out_of_memory
        output = self._run(latents, args, kwargs)
        with self._lock:
            cap = self._too_many.get(images)
            if cap is not None and self.out_of_memory == ran_out and int(latents.shape[0]) >= cap - 1:
                self._fitted_at_cap(images, cap)
        return output

    def too_many(self, latents: torch.Tensor) -> int | None:
        """Images of `latents`' size in the smallest decode that ran out of memory (since its
        last rise), or None."""
        return self._too_many.get(tuple(int(n) for n in latents.shape[1:]))

    def _fitted_at_cap(self, images: tuple[int, ...], cap: int) -> None:
        fits = self._fits_at_cap.get(images, 0) + 1
        if fits < RAISE_AFTER_FITS:
            self._fits_at_cap[images] = fits
            return
        self._fits_at_cap[images] = 0
        self._too_many[images] = cap + 1
        logger.info("decodes of %s may hold %d images again", images, cap)

    def _run(self, latents: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        size = int(latents.shape[0])
        if self.limit is not None and size > (allowed := self.limit.images(latents)):
            return self._pieces(latents, args, kwargs, _chunks(size, allowed))
        too_many = self.too_many(latents)
        if size > 1 and too_many is not None and size >= too_many:
            return self._pieces(latents, args, kwargs, [size // 2, size - size // 2])
        try:
            tiled = contextlib.nullcontext() if self.limit is None else self.limit.tiled(latents)
            with tiled:
                return self.inner(latents, *args, **kwargs)
        except Exception as exc:
            if size == 1 or not is_out_of_memory(exc):
                raise
            logger.warning("decoding %d images ran out of memory (%s); decoding them in halves", size, exc)
        # Out of the `except` block: the failed attempt's frames (and the activations they
        # hold) are freed before the halves run.
        images = tuple(int(n) for n in latents.shape[1:])
        with self._lock:
            self.out_of_memory += 1
            self._too_many[images] = size if too_many is None else min(too_many, size)
            self._fits_at_cap[images] = 0
        return self._pieces(latents, args, kwargs, [size // 2, size - size // 2])

    def _pieces(
        self, latents: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], sizes: list[int]
    ) -> Any:
        """Decode `latents` in consecutive pieces of `sizes` images, each through `_run`
        again, and join the outputs in order."""
        size = int(latents.shape[0])
        outputs, start = [], 0
        for count in sizes:
            part = slice(start, start + count)
            start += count
            part_args = [_part(value, size, part) for value in args]
            part_kwargs = {name: _part(value, size, part) for name, value in kwargs.items()}
            outputs.append(self._run(latents[part], tuple(part_args), part_kwargs))
        return _join(outputs)


def _chunks(size: int, most: int) -> list[int]:
    """`size` images as pieces of `most`, the last one smaller."""
    return [min(most, size - start) for start in range(0, size, most)]


def _part(value: Any, size: int, part: slice) -> Any:
    """`value`'s entries for the images in `part`, if it has one entry per image."""
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == size:
        return value[part]
    if isinstance(value, list | tuple) and len(value) == size:
        return value[part]
    return value


def _join(outputs: list[Any]) -> Any:
    """Decode outputs as one: tensors concatenated along the batch (one copy, however many
    pieces); tuples and diffusers' `DecoderOutput` (a dict-like dataclass) field by field."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, tuple):
        return tuple(_join(list(fields)) for fields in zip(*outputs, strict=True))
    if isinstance(first, dict):
        return type(first)(**{name: _join([output[name] for output in outputs]) for name in first})
    return first


def decode_in_halves(vae: Any) -> None:
    """Make `vae.decode` a `HalvingDecode` (once: an adapter built twice over one pipeline
    keeps the first)."""
    decode = getattr(vae, "decode", None)
    if decode is None or isinstance(decode, HalvingDecode):
        return
    vae.decode = HalvingDecode(decode)


def out_of_memory_count(vae: Any) -> int:
    """Decodes of `vae` that ran out of memory and were halved so far (0 if it is not a
    `HalvingDecode`)."""
    decode = getattr(vae, "decode", None)
    return decode.out_of_memory if isinstance(decode, HalvingDecode) else 0
