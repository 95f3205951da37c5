"""The hooks step mode's First-Block Cache puts on a family's denoisers' blocks
(`pipelines.cache.first_block` says what they decide).

The same hooks machinery as diffusers (`HookRegistry`), installed once on each denoiser a
family steps with (`Family.cached_denoisers`: Wan 2.2's two experts) and passive while no
step is active. The head block of the forward that runs starts a `CachedForward` for the
rows it carries (`pipelines.cache.calls`); the other blocks run on the rows that compute,
or pass their input through where none does; the last one assembles every row's output.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch import Tensor

from pipelines.cache.block_args import BlockArgs, block_args
from pipelines.cache.calls import current_call
from pipelines.cache.first_block import CachedForward, CachedStep

if TYPE_CHECKING:
    from pipelines.stepping.state import DenoiseState

_HOOK = "diffbatch_first_block_cache"


def denoiser_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformer's blocks in the order they run (diffusers' names for block lists)."""
    return [
        block
        for name, child in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
        for block in child
    ]


class RowFirstBlockCache:
    """First-Block Cache hooks on denoisers' blocks, deciding per request. Passive (each
    block its own forward) unless a step is active (`step`)."""

    def __init__(self, transformers: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        denoisers = [transformers] if isinstance(transformers, torch.nn.Module) else list(transformers)
        self.active: CachedStep | None = None
        self.forward: CachedForward | None = None  # the forward running now
        self.blocks_skipped = 0
        self.rest_blocks = 0
        layouts = [denoiser_blocks(transformer) for transformer in denoisers]
        # Every denoiser checked before any hook goes on: a refusal must not leave the first
        # one's hooks behind (the next try would fail on "hook already exists").
        for transformer, blocks in zip(denoisers, layouts, strict=True):
            if len(blocks) < 2:
                raise ValueError(f"{type(transformer).__name__} has no transformer blocks to cache")
            for block in blocks:
                block_args(block)
        for blocks in layouts:
            rest = len(blocks) - 1
            self.rest_blocks = self.rest_blocks or rest
            last = len(blocks) - 1
            for index, block in enumerate(blocks):
                role = "head" if index == 0 else "tail" if index == last else "rest"
                registry = HookRegistry.check_if_exists_or_initialize(block)
                registry.register_hook(_BlockHook(self, role, rest), _HOOK)

    @contextmanager
    def step(self, states: Sequence[DenoiseState]) -> Iterator[CachedStep | None]:
        """Cache this group's forwards while inside; None (every block runs, nothing cached)
        when no request of the group caches. `commit` the step once it has succeeded."""
        if not any(state.cache is not None for state in states):
            yield None
            return
        self.active = CachedStep(states)
        try:
            yield self.active
        finally:
            self.active = None
            self.forward = None

    def commit(self, step: CachedStep | None) -> None:
        if step is not None:
            self.blocks_skipped += step.commit()


class _BlockHook(ModelHook):  # type: ignore[misc]  # diffusers' hooks are untyped
    def __init__(self, cache: RowFirstBlockCache, role: str, rest_blocks: int) -> None:
        super().__init__()
        self.cache = cache
        self.role = role
        self.rest_blocks = rest_blocks
        self._args: BlockArgs | None = None
        self._signature: inspect.Signature | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._args = block_args(module)
        # Blocks are called with positional arguments too (Wan's): bound by name to cut rows.
        self._signature = inspect.signature(module.forward)
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        step = self.cache.active
        original = self.fn_ref.original_forward
        if step is None:
            return original(*args, **kwargs)
        spec = self._args
        assert self._signature is not None and spec is not None
        bound = self._signature.bind(*args, **kwargs)
        if self.role == "head":
            starting = step.forward(current_call(), self.rest_blocks)
            self.cache.forward = starting
            output = original(*bound.args, **bound.kwargs)
            hidden, second = self._streams(output)
            starting.decide(bound.arguments[spec.hidden], hidden, second)
            return output
        forward = self.cache.forward
        assert forward is not None, "a block ran before its denoiser's first block"
        if forward.all_skip:
            hidden_in = bound.arguments[spec.hidden]
            if self.role == "tail":
                length = hidden_in.shape[1]
                return self._output(
                    *forward.assemble(None, None, length=length, second_kept=spec.second_kept)
                )
            return self._output(hidden_in, None if spec.second is None else bound.arguments.get(spec.second))
        for name in spec.per_row & bound.arguments.keys():
            bound.arguments[name] = _cut(forward, bound.arguments[name], False)
        for name in spec.per_row_and_shared & bound.arguments.keys():
            bound.arguments[name] = _cut(forward, bound.arguments[name], True)
        output = original(*bound.args, **bound.kwargs)
        if self.role == "tail":
            hidden, second = self._streams(output)
            merged = forward.assemble(hidden, second, length=hidden.shape[1], second_kept=spec.second_kept)
            return self._output(*merged)
        return output

    def _streams(self, output: Any) -> tuple[Tensor, Tensor | None]:
        spec = self._args
        assert spec is not None
        if not isinstance(output, tuple) or spec.hidden_index is None:
            return output, None
        second = spec.second_index
        return output[spec.hidden_index], None if second is None else output[second]

    def _output(self, hidden: Tensor, second: Tensor | None) -> Any:
        """A block's output in its own layout."""
        spec = self._args
        assert spec is not None
        if spec.hidden_index is None or spec.second_index is None:
            return hidden
        output: list[Tensor | None] = [None, None]
        output[spec.hidden_index] = hidden
        output[spec.second_index] = second
        return tuple(output)


def _cut(forward: CachedForward, value: Any, shared_after: bool) -> Any:
    """A per-row argument (a tensor, a tuple of them: rotary cos and sin, or a dict of keyword
    arguments: FLUX's attention mask of a padded grid) cut to the rows that compute."""
    if isinstance(value, Tensor):
        return forward.rows_of(value, shared_after)
    if isinstance(value, tuple) and all(isinstance(part, Tensor) for part in value):
        return tuple(forward.rows_of(part, shared_after) for part in value)
    if isinstance(value, dict):
        return {name: _cut(forward, part, shared_after) for name, part in value.items()}
    return value
