"""Step-level batching, the part every family shares: a request's denoising state, and one
denoising step taken by many requests in one denoiser forward.

Each request owns a copy of the pipeline's scheduler (schedulers keep per-run state: step
index, multistep history, `init_noise_sigma` after `set_timesteps`), its own latents and
generators, and its encoded prompt. A step concatenates every request's rows — its
negative rows first when it uses classifier-free guidance, then its positive rows — runs
the denoiser once with a per-row timestep, splits the prediction back, applies each
request's own guidance scale, and steps each request's own scheduler. Rows of a request
without guidance take the conditional prediction itself (`u + 1 * (c - u)` is not bitwise
`c`), so a request's image is the one the stock pipeline makes for it alone, within float
tolerance, whoever it shared its steps with.

A family supplies the rest through the stages' hooks (`pipelines.step_level`): how
to encode its joiners, set up one request, call its denoiser, and decode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from engine.request import GenerationRequest, preview_steps
from pipelines.cache.records import FirstBlockCache, TaylorSeerCache
from pipelines.stepping.preview import clean_estimate

# Per-row conditioning of a denoiser call, by argument name; every tensor has one row per image.
Conditioning = dict[str, torch.Tensor]
# A request's encoded prompt: (positive rows, negative rows or None without guidance).
Encoded = tuple[Conditioning, Conditioning | None]

# (the states as the rows show them, latent rows, per-row timesteps, conditioning) -> the
# denoiser's prediction for each row.
Denoiser = Callable[[list["DenoiseState"], torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
# Rows of many requests into one denoiser input (by default: concatenated).
Merge = Callable[[list[Conditioning]], Conditioning]
# (the request, its prediction without the prompt, with it) -> the guided prediction. The
# state gives the request's scale, and its step where guidance changes along the schedule
# (Z-Image's `cfg_truncation`).
Guide = Callable[["DenoiseState", torch.Tensor, torch.Tensor], torch.Tensor]


def padded_cat(rows: list[torch.Tensor]) -> torch.Tensor:
    """Latent rows of every request as one batch: concatenated, or, where their shapes differ
    (a family that mixes sizes, `Family.mixes_sizes`), each zero-padded at the end of every
    axis to the largest, its own values first. The family's denoiser knows each row's own
    size from its state; `_guided` cuts each prediction back to it."""
    shapes = {tuple(row.shape[1:]) for row in rows}
    if len(shapes) == 1:
        return torch.cat(rows)
    largest = [max(sizes) for sizes in zip(*shapes, strict=True)]
    padded = []
    for row in rows:
        pad: list[int] = []
        for have, want in reversed(list(zip(row.shape[1:], largest, strict=True))):
            pad.extend((0, want - have))
        padded.append(torch.nn.functional.pad(row, pad))
    return torch.cat(padded)


def concatenate(conds: list[Conditioning]) -> Conditioning:
    return {name: torch.cat([cond[name] for cond in conds]) for name in conds[0]}


class LastMerge:
    """The last step's merged conditioning, given again while the same requests step on:
    a group that did not change would otherwise concatenate (Qwen-Image: pad, then
    concatenate) every request's prompt rows anew each step. It holds the conditionings it
    merged, so none of them can be freed and another take its place unnoticed."""

    def __init__(self) -> None:
        self._conds: list[Conditioning] = []
        self._values: list[tuple[torch.Tensor, ...]] = []
        self._merged: Conditioning | None = None

    def merged(self, merge: Merge, conds: list[Conditioning]) -> Conditioning:
        values = [tuple(cond.values()) for cond in conds]
        if self._merged is None or not self._same(conds, values):
            self._conds, self._values, self._merged = list(conds), values, merge(conds)
        return self._merged

    def _same(self, conds: list[Conditioning], values: list[tuple[torch.Tensor, ...]]) -> bool:
        # By identity: `==` on tensors compares their values, element by element.
        if len(conds) != len(self._conds) or any(a is not b for a, b in zip(conds, self._conds, strict=True)):
            return False
        return all(
            len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs, strict=True))
            for mine, theirs in zip(values, self._values, strict=True)
        )

    def forget(self) -> None:
        """Let go of the last group's conditioning (its requests finished)."""
        self._conds, self._values, self._merged = [], [], None


def classifier_free(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    return uncond + scale * (cond - uncond)


def classifier_free_guide(state: DenoiseState, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    return classifier_free(uncond, cond, state.guidance_scale)


@dataclass(eq=False)
class DenoiseState:
    """One request between its steps. `uncond` is None when it takes no guidance."""

    request: GenerationRequest
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    guidance_scale: float
    generators: list[torch.Generator]
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    # Index of its first timestep in its scheduler's own: 0, or part-way for image-to-image,
    # whose strength skips the first steps (diffusers' `get_timesteps`).
    first_step: int = 0
    # Called after each of its scheduler steps (inpainting puts the input back outside the
    # mask there, as diffusers' inpainting pipelines do), or None.
    after_step: Callable[[DenoiseState], None] | None = None
    # After which steps to preview (`partial_images`), and the clean-latent estimate of the
    # last such step until it has been decoded and sent.
    preview_at: tuple[int, ...] = ()
    preview: torch.Tensor | None = None
    previews_sent: int = 0
    # Its First-Block Cache (`pipelines.cache.first_block`), or None: every block runs.
    cache: FirstBlockCache | None = None
    # Its TaylorSeer series (`pipelines.cache.taylor_seer`), or None: every step computes.
    taylor_seer: TaylorSeerCache | None = None
    # Its control images, one row each, in its request's `controls` order (`pipelines.controlnet`).
    control_images: tuple[torch.Tensor, ...] = ()
    # Its reference images' embeddings, one per row (negative rows, then positive), in its
    # request's `ip_adapters` order (`pipelines.ip_adapter`).
    ip_embeds: tuple[torch.Tensor, ...] = ()

    @classmethod
    def start(
        cls,
        request: GenerationRequest,
        scheduler: Any,
        latents: torch.Tensor,
        *,
        prompts: Encoded,
        guidance_scale: float,
        generators: list[torch.Generator],
        step_kwargs: dict[str, Any] | None = None,
        first_step: int = 0,
    ) -> DenoiseState:
        """A request at step 0 of its own schedule (its scheduler's from `first_step` on)."""
        cond, uncond = prompts
        timesteps = scheduler.timesteps[first_step:]
        kwargs = step_kwargs or {}
        params = request.params
        previews = preview_steps(len(timesteps), params.partial_images) if params.output_type == "np" else ()
        state = cls(request, scheduler, timesteps, latents, cond, uncond, guidance_scale, generators, kwargs)
        state.preview_at, state.first_step = previews, first_step
        return state

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def is_done(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def num_images(self) -> int:
        return self.latents.shape[0]

    @property
    def rows(self) -> int:
        """Rows this request adds to a denoiser forward."""
        return self.latents.shape[0] * (1 if self.uncond is None else 2)


@dataclass(frozen=True, eq=False)
class RowBlock:
    """One branch of one state in a step's forward: its negative rows or its positive rows
    (all of a request without guidance), as `step_together` lays them out."""

    state: DenoiseState
    negative: bool
    latents: torch.Tensor
    timesteps: torch.Tensor
    cond: Conditioning

    @property
    def rows(self) -> int:
        return int(self.latents.shape[0])

    def view(self) -> DenoiseState:
        """The state as the family's denoiser sees these rows alone: a request without
        guidance whose conditioning is this branch's (`rows` then counts these rows only)."""
        return replace(self.state, cond=self.cond, uncond=None)


# Runs some of a step's blocks through the denoiser: their predictions, in block order.
RunBlocks = Callable[[list[RowBlock]], torch.Tensor]


class RowSplit(Protocol):
    """Where a step's forward is shared out between the devices of a lane
    (`pipelines.parallel.lane_split`): each runs some blocks, and every device gets the
    prediction of every block, in block order (each block's rows zero-padded to the
    largest block's shape where shapes differ, as `padded_cat` pads them)."""

    @property
    def leads(self) -> bool:
        """Whether this device leads the lane: it decodes and answers, the others only step."""
        ...

    def forward(self, blocks: list[RowBlock], run: RunBlocks) -> torch.Tensor: ...


def step_together(
    states: list[DenoiseState],
    denoise: Denoiser,
    merge: Merge = concatenate,
    guide: Guide = classifier_free_guide,
    known: Sequence[torch.Tensor | None] | None = None,
    *,
    before_commit: Callable[[list[torch.Tensor]], None] | None = None,
    split: RowSplit | None = None,
) -> list[torch.Tensor]:
    """Advance every state by one step with ONE denoiser forward; each one's guided
    prediction (what its scheduler stepped with).

    Nothing changes until every row has been computed: the forward, then each request's
    scheduler step on a trial copy (`_trial_step`). Only when all have succeeded are the
    states committed, so if anything raises no request has moved (its scheduler history
    and its generators included) and each can be retried alone. A state whose guided
    prediction is `known` already (TaylorSeer's, `pipelines.cache.taylor_seer`) adds no
    rows to the forward; with none left, there is no forward. `before_commit(guided)` runs
    after every trial step and before the states move: what it raises leaves them unmoved
    too (TaylorSeer's series update, `RowTaylorSeer.learn`). With a `split` the forward's
    blocks are shared out between a lane's devices, each running its own through the
    denoiser (`RowSplit`); everything after the forward runs on every device alike.
    """
    given = list(known) if known is not None else [None] * len(states)
    computing = [state for state, prediction in zip(states, given, strict=True) if prediction is None]
    blocks = [block for state in computing for block in _blocks(state)]

    def run(part: list[RowBlock], seen: list[DenoiseState]) -> torch.Tensor:
        latents = padded_cat([block.latents for block in part])
        return denoise(seen, latents, torch.cat([b.timesteps for b in part]), merge([b.cond for b in part]))

    prediction = None
    if blocks and split is None:
        prediction = run(blocks, computing)
    elif blocks and split is not None:
        prediction = split.forward(blocks, lambda part: run(part, [block.view() for block in part]))
    padded = len({tuple(block.latents.shape[1:]) for block in blocks}) > 1
    guided = _guided(states, given, prediction, guide, padded=padded)
    generators = _generator_states(states)
    try:
        trials = _trial_steps(states, guided)
        if before_commit is not None:
            before_commit(guided)
    except BaseException:
        # An ancestral scheduler drew noise for the requests before the failing one.
        for generator, saved in generators:
            generator.set_state(saved)
        raise
    for state, trial in zip(states, trials, strict=True):
        vars(state).update(vars(trial))
    return guided


def _blocks(state: DenoiseState) -> list[RowBlock]:
    """A state's rows in a forward: its negative rows first when it is guided, then its
    positive rows, at its timestep, scaled by its scheduler."""
    t = state.timesteps[state.steps_done]
    x = state.latents
    if hasattr(state.scheduler, "scale_model_input"):
        x = state.scheduler.scale_model_input(x, t)
    times = t.reshape(1).to(torch.float32).expand(x.shape[0])
    branches = ((True, state.uncond), (False, state.cond))
    return [RowBlock(state, negative, x, times, cond) for negative, cond in branches if cond is not None]


def _trial_steps(states: list[DenoiseState], guided: list[torch.Tensor]) -> list[DenoiseState]:
    """Each state after its scheduler step, as new states (`_trial_step`); the states at the
    same point of the same elementwise schedule take one scheduler step together, as the
    stock pipeline's batch does (`_step_key`)."""
    trials: list[DenoiseState | None] = [None] * len(states)
    together: dict[tuple[Any, ...], list[int]] = {}
    for index, state in enumerate(states):
        key = _step_key(state)
        if key is None:
            trials[index] = _trial_step(state, guided[index])
        else:
            together.setdefault(key, []).append(index)
    for indices in together.values():
        group = [states[i] for i in indices]
        stepped = _trial_step_together(group, [guided[i] for i in indices])
        for index, trial in zip(indices, stepped, strict=True):
            trials[index] = trial
    return [trial for trial in trials if trial is not None]


def _step_key(state: DenoiseState) -> tuple[Any, ...] | None:
    """What states must share to take one scheduler step together, or None where a state
    steps alone. Only diffusers' deterministic flow-matching Euler step qualifies: it is
    `sample + (sigma_next - sigma) * prediction`, elementwise, so rows at the same sigmas
    get the same bits batched or alone, and its only state is the step index. Its sigmas
    stay on the CPU (diffusers keeps them there), so reading them waits for no device."""
    scheduler = state.scheduler
    if type(scheduler) is not FlowMatchEulerDiscreteScheduler or scheduler.config.stochastic_sampling:
        return None
    if state.step_kwargs or state.after_step is not None or scheduler.sigmas.device.type != "cpu":
        return None
    index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
    if index is None:
        return None
    sigmas = tuple(scheduler.sigmas[index : index + 2].tolist())
    latents = state.latents
    return (sigmas, index, tuple(latents.shape[1:]), latents.dtype, latents.device)


def _trial_step_together(states: list[DenoiseState], guided: list[torch.Tensor]) -> list[DenoiseState]:
    """`_trial_step` for states that share a `_step_key`: one scheduler step over all their
    rows on a fork of the first one's scheduler, each state's rows a view of the result,
    and each state's own fork moved to the next step index as its step would have."""
    if len(states) == 1:
        return [_trial_step(states[0], guided[0])]
    trials = [_copy(state) for state in states]
    for trial in trials:
        trial.scheduler = _fork(trial.scheduler)
    lead = trials[0]  # its scheduler takes the step; the others' move to where it went
    t = lead.timesteps[lead.steps_done]
    samples = [state.latents for state in states]
    batched = lead.scheduler.step(torch.cat(guided), t, torch.cat(samples), return_dict=False)[0]
    rows = batched.split([sample.shape[0] for sample in samples])
    for trial, noise, sample, own in zip(trials, guided, samples, rows, strict=True):
        trial.scheduler._step_index = lead.scheduler.step_index
        _advanced(trial, sample, noise, own, (own,))
    return trials


def _trial_step(state: DenoiseState, noise: torch.Tensor) -> DenoiseState:
    """`state` after its scheduler step with `noise`, as a new state on a fork of its
    scheduler: `state` itself is left as it was."""
    sample = state.latents
    t = state.timesteps[state.steps_done]
    trial = _copy(state)
    trial.scheduler = _fork(state.scheduler)
    stepped = trial.scheduler.step(noise, t, sample, **state.step_kwargs, return_dict=False)
    _advanced(trial, sample, noise, stepped[0], stepped)
    return trial


def _advanced(
    trial: DenoiseState, sample: torch.Tensor, noise: torch.Tensor, latents: torch.Tensor, stepped: Any
) -> None:
    """`trial` (stepped from `sample` with `noise`) at its next step: its latents, the task's
    `after_step`, and its preview where one is due."""
    index = trial.steps_done
    # In the latents' own dtype, as diffusers' pipelines keep them (`latents_dtype`): a
    # scheduler hands its step back in the prediction's dtype, which a denoiser in a dtype
    # of its own (`--component-dtypes transformer=...`) would carry into the next step and
    # the VAE.
    trial.latents = latents.to(sample.dtype)
    trial.steps_done = index + 1
    if trial.after_step is not None:
        trial.after_step(trial)
    if trial.steps_done in trial.preview_at:
        at = trial.first_step + index
        t = trial.timesteps[index]
        trial.preview = clean_estimate(trial.scheduler, sample, noise, t=t, index=at, stepped=stepped)


def _copy(state: DenoiseState) -> DenoiseState:
    """A shallow copy of `state` (its fields shared, not copied), without running the
    dataclass's `__init__` as `dataclasses.replace` would: a step makes one per request."""
    trial: DenoiseState = object.__new__(type(state))
    vars(trial).update(vars(state))
    return trial


def _fork(scheduler: Any) -> Any:
    """A copy of `scheduler` that its `step` can advance without touching the original:
    schedulers rebind their counters and tensors, but keep multistep history in lists they
    change in place (`model_outputs`, `timestep_list`, `ets`, `derivatives`), so those are
    copied; the tensors themselves are shared, never copied, and so is the config (a
    `FrozenDict`, which nothing changes: copying it rebuilds it key by key)."""
    fork = object.__new__(type(scheduler))  # as `copy.copy` would, without its detour
    vars(fork).update(vars(scheduler))
    for name, value in vars(scheduler).items():
        if isinstance(value, list | dict | set) and not isinstance(value, FrozenDict):
            setattr(fork, name, copy.copy(value))
    return fork


def _guided(
    states: list[DenoiseState],
    given: Sequence[torch.Tensor | None],
    prediction: torch.Tensor | None,
    guide: Guide,
    *,
    padded: bool = False,
) -> list[torch.Tensor]:
    """Each state's guided prediction: its `given` one, else cut from the forward's rows (and,
    where rows were `padded` to one shape, cut back to the state's own)."""
    guided = []
    offset = 0
    for state, own in zip(states, given, strict=True):
        n = state.latents.shape[0]
        if own is not None:
            guided.append(own)
            continue
        assert prediction is not None
        rows = prediction[offset : offset + state.rows]
        if padded:  # its own values come first on every axis (`padded_cat`)
            rows = rows[(slice(None), *(slice(0, size) for size in state.latents.shape[1:]))]
        if state.uncond is None:
            guided.append(rows)
        else:
            guided.append(guide(state, rows[:n], rows[n:]))
        offset += state.rows
    return guided


def _generator_states(states: list[DenoiseState]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each generator a scheduler step draws from (an ancestral scheduler's, passed in its
    `step_kwargs`), with its state now."""
    generators: dict[int, torch.Generator] = {}
    for state in states:
        drawn = state.step_kwargs.get("generator")
        for generator in drawn if isinstance(drawn, list) else [drawn] if drawn is not None else []:
            generators[id(generator)] = generator
    return [(generator, generator.get_state()) for generator in generators.values()]
