"""First-Block Cache per request inside a shared denoising step (issue 27, step mode).

diffusers' First-Block Cache (`diffusers.hooks.first_block_cache`) splits a transformer's
blocks into a head (the first) and the rest: the head always runs, and when its residual
(output - input) changed by less than a threshold since the last step that ran everything,
the rest is replaced by the residual they added then ("tail residual"). It decides once
for the whole batch. Here each request decides for itself, in the same forward: the head
runs on every row, each request compares its own rows' residual with its own previous one,
the requests that must compute run the rest of the blocks as a sub-batch, and the others
take their head output plus their own cached tail residual. So a request's image does not
depend on who shared its steps (to the batching tolerance; a decision can flip only where a
request's change sits within float rounding of its threshold).

The same hooks machinery as diffusers (`HookRegistry`, `TransformerBlockRegistry` for which
output is the image stream), installed once on the transformer and passive while no step
is active. A request's cache (`FirstBlockCache`) lives in its `DenoiseState`; a step's
`CachedStep` computes new ones and `commit`s them only once the whole step succeeded, as
`step_together` commits its states, so a failed step leaves every request as it was.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch import Tensor

from pipelines.cache.row_decisions import Segment, changes, rows_index

if TYPE_CHECKING:
    from pipelines.stepping.state import DenoiseState

_HOOK = "diffbatch_first_block_cache"
# Block arguments with one row per batch row (a skipping request's rows are cut from them);
# everything else (rotary embeddings, attention kwargs) is shared by every row.
_PER_ROW = frozenset(
    {
        "hidden_states",
        "encoder_hidden_states",
        "temb",
        "encoder_hidden_states_mask",
        "attention_mask",
        "encoder_attention_mask",
    }
)


@dataclass(frozen=True, slots=True)
class FirstBlockCache:
    """One request's cache, kept in its `DenoiseState` and dropped with it. The residuals
    are of the last step that ran every block, for this request's rows only."""

    threshold: float
    head_residual: Tensor | None = None
    # The rest of the blocks' effect on the image stream and the text stream (None where
    # the last block returns no text stream).
    tail_residuals: tuple[Tensor, Tensor | None] | None = None
    steps_skipped: int = 0
    blocks_skipped: int = 0


class CachedStep:
    """One denoiser forward of a step group: what the head decided, row by row."""

    def __init__(self, states: Sequence[DenoiseState], rest_blocks: int) -> None:
        self.states = list(states)
        self.rest_blocks = rest_blocks
        self.segments: list[Segment] = []
        start = 0
        for state in states:
            self.segments.append(Segment(start, start + state.rows, state.cache))
            start += state.rows
        self.rows = start
        self.head_output: tuple[Tensor, Tensor | None] | None = None
        self.compute_index: Tensor | None = None  # rows that run the rest (mixed steps)
        self._cut: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def all_compute(self) -> bool:
        return all(segment.compute for segment in self.segments)

    @property
    def all_skip(self) -> bool:
        return not any(segment.compute for segment in self.segments)

    def decide(self, hidden_in: Tensor, hidden_out: Tensor, encoder_out: Tensor | None) -> None:
        """Each cached request's skip decision from its own head residual, with one host sync
        for the whole group (as diffusers' `.item()` is one per batch) and a fixed number of
        tensor operations however many requests compare: on a small model each operation
        costs more than its arithmetic, so a loop of them per request ate what skipping saved."""
        if hidden_out.shape[0] != self.rows:
            raise RuntimeError(
                f"first-block cache: a forward of {hidden_out.shape[0]} rows, expected {self.rows}"
            )
        self.head_output = (hidden_out, encoder_out)
        residual = hidden_out - hidden_in
        compared = [
            segment
            for segment in self.segments
            if segment.cache is not None
            and segment.cache.head_residual is not None
            and segment.cache.tail_residuals is not None
        ]
        for segment, change in zip(compared, changes(residual, compared, self.rows), strict=True):
            cache = segment.cache
            assert cache is not None
            if change <= cache.threshold:  # diffusers' rule
                segment.compute = False
                # The residual compared against stays the last computed step's (diffusers').
                segment.new = replace(
                    cache,
                    steps_skipped=cache.steps_skipped + 1,
                    blocks_skipped=cache.blocks_skipped + self.rest_blocks,
                )
        for segment in self.segments:
            if segment.cache is not None and segment.compute:
                # Its own copy: a view would keep the whole group's residual alive.
                whole = segment.stop - segment.start == self.rows
                own = residual if whole else residual[segment.start : segment.stop].clone()
                segment.new = replace(segment.cache, head_residual=own)
        if not self.all_compute and not self.all_skip:
            self.compute_index = rows_index(self.segments, hidden_out.device, compute=True)

    def rows_of(self, value: Tensor) -> Tensor:
        """A per-row argument cut to the rows that compute (unchanged if already cut). Each
        tensor is cut once per step: every block gets the same `temb`."""
        if self.compute_index is None or value.shape[0] != self.rows:
            return value
        kept = self._cut.get(id(value))
        if kept is None or kept[0] is not value:
            kept = (value, value.index_select(0, self.compute_index))
            self._cut[id(value)] = kept  # the original is held too, so its id stays its own
        return kept[1]

    def assemble(self, hidden: Tensor | None, encoder: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The last block's output for every row: the computed rows as computed (`hidden`,
        `encoder`: the sub-batch, or None when nobody computed), the skipping ones as their
        head output plus their cached tail residual. Records the computed requests' new
        tail residuals."""
        assert self.head_output is not None
        head_hidden, head_encoder = self.head_output
        hiddens: list[Tensor] = []
        encoders: list[Tensor] = []
        offset = 0
        for segment in self.segments:
            rows = slice(segment.start, segment.stop)
            if segment.compute:
                n = segment.stop - segment.start
                own_hidden = hidden[offset : offset + n]  # type: ignore[index]
                own_encoder = None if encoder is None else encoder[offset : offset + n]
                offset += n
                if segment.new is not None:
                    residuals = (
                        own_hidden - head_hidden[rows],
                        None
                        if own_encoder is None or head_encoder is None
                        else own_encoder - head_encoder[rows],
                    )
                    segment.new = replace(segment.new, tail_residuals=residuals)
            else:
                cached = segment.cache.tail_residuals  # type: ignore[union-attr]
                assert cached is not None
                own_hidden = head_hidden[rows] + cached[0]
                own_encoder = (
                    None if head_encoder is None or cached[1] is None else head_encoder[rows] + cached[1]
                )
            hiddens.append(own_hidden)
            if own_encoder is not None:
                encoders.append(own_encoder)
        if self.all_compute and hidden is not None:
            return hidden, encoder  # nothing changed: exactly the blocks' own output
        merged_encoder = torch.cat(encoders) if len(encoders) == len(self.segments) else None
        return torch.cat(hiddens), merged_encoder

    def commit(self) -> int:
        """Give each request its new cache; the blocks skipped in this step."""
        skipped = 0
        for state, segment in zip(self.states, self.segments, strict=True):
            if segment.new is not None:
                state.cache = segment.new
            if not segment.compute:
                skipped += self.rest_blocks
        return skipped


def denoiser_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformer's blocks in the order they run (diffusers' names for block lists)."""
    return [
        block
        for name, child in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
        for block in child
    ]


class RowFirstBlockCache:
    """First-Block Cache hooks on a transformer's blocks, deciding per request. Passive (each
    block its own forward) unless a step is active (`step`)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        blocks = denoiser_blocks(transformer)
        if len(blocks) < 2:
            raise ValueError(f"{type(transformer).__name__} has no transformer blocks to cache")
        self.rest_blocks = len(blocks) - 1
        self.active: CachedStep | None = None
        self.blocks_skipped = 0
        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            role = "head" if index == 0 else "tail" if index == last else "rest"
            registry = HookRegistry.check_if_exists_or_initialize(block)
            registry.register_hook(_BlockHook(self, role), _HOOK)

    @contextmanager
    def step(self, states: Sequence[DenoiseState]) -> Iterator[CachedStep | None]:
        """Cache this group's forward while inside; None (every block runs, nothing cached)
        when no request of the group caches. `commit` the step once it has succeeded."""
        if not any(state.cache is not None for state in states):
            yield None
            return
        self.active = CachedStep(states, self.rest_blocks)
        try:
            yield self.active
        finally:
            self.active = None

    def commit(self, step: CachedStep | None) -> None:
        if step is not None:
            self.blocks_skipped += step.commit()


class _BlockHook(ModelHook):  # type: ignore[misc]  # diffusers' hooks are untyped
    def __init__(self, cache: RowFirstBlockCache, role: str) -> None:
        super().__init__()
        self.cache = cache
        self.role = role
        self._metadata: TransformerBlockMetadata | None = None
        self._signature: inspect.Signature | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._metadata = TransformerBlockRegistry.get(type(module))
        # Blocks are called with positional arguments too (Wan's): bound by name to cut rows.
        self._signature = inspect.signature(module.forward)
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        step = self.cache.active
        original = self.fn_ref.original_forward
        if step is None:
            return original(*args, **kwargs)
        assert self._signature is not None
        bound = self._signature.bind(*args, **kwargs)
        if self.role == "head":
            output = original(*bound.args, **bound.kwargs)
            hidden, encoder = self._streams(output)
            step.decide(bound.arguments["hidden_states"], hidden, encoder)
            return output
        if step.all_skip:
            if self.role == "tail":
                return self._output(*step.assemble(None, None))
            return self._output(
                bound.arguments["hidden_states"], bound.arguments.get("encoder_hidden_states")
            )
        for name in _PER_ROW & bound.arguments.keys():
            value = bound.arguments[name]
            if isinstance(value, Tensor):
                bound.arguments[name] = step.rows_of(value)
        output = original(*bound.args, **bound.kwargs)
        if self.role == "tail":
            return self._output(*step.assemble(*self._streams(output)))
        return output

    def _streams(self, output: Any) -> tuple[Tensor, Tensor | None]:
        metadata = self._metadata
        assert metadata is not None
        if not isinstance(output, tuple):
            return output, None
        text = metadata.return_encoder_hidden_states_index
        return output[metadata.return_hidden_states_index], None if text is None else output[text]

    def _output(self, hidden: Tensor, encoder: Tensor | None) -> Any:
        """A block's output in its own layout (diffusers' metadata says which is which)."""
        metadata = self._metadata
        assert metadata is not None
        text = metadata.return_encoder_hidden_states_index
        if text is None:
            return hidden
        output: list[Tensor | None] = [None, None]
        output[metadata.return_hidden_states_index] = hidden
        output[text] = encoder
        return tuple(output)
