"""A preset's scheduler and fixed timesteps: distilled models run a few fixed timesteps with a
scheduler of their own (DMD2's SDXL UNet: LCMScheduler at 999, 749, 499, 249).

The scheduler replaces the model's at load, built from the model's scheduler config as
diffusers' model cards do (`LCMScheduler.from_config(pipe.scheduler.config)`). Fixed timesteps
go to every request: as `timesteps=` in a request-level call (diffusers' `retrieve_timesteps`)
and to each request's own scheduler copy in step mode, where a family's stages take them
(`Family.fixed_timesteps`); a family whose stages do not is served request-level.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from pipelines.base import PipelineConfig


def scheduler_class(name: str) -> Any:
    """The diffusers scheduler class `name`; ValueError naming the setting otherwise."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin)):
        raise ValueError(f"scheduler: diffusers has no scheduler class {name!r} (e.g. LCMScheduler)")
    return cls


def takes_timesteps(scheduler: Any) -> bool:
    """Whether the scheduler's `set_timesteps` takes a list of timesteps (diffusers'
    `retrieve_timesteps` asks the same)."""
    return "timesteps" in inspect.signature(scheduler.set_timesteps).parameters


def configured_scheduler(template: Any, config: PipelineConfig) -> Any:
    """The model's scheduler (`template`), or the configured class built from its config;
    checked against the fixed timesteps, which it must take (and accept: diffusers refuses
    timesteps past its training schedule)."""
    scheduler = template
    if config.scheduler:
        scheduler = scheduler_class(config.scheduler).from_config(template.config)
    if config.timesteps:
        if not takes_timesteps(scheduler):
            name = type(scheduler).__name__
            raise ValueError(f"timesteps: {name} takes no fixed timesteps; choose a scheduler that does")
        if scheduler.config.get("use_dynamic_shifting", False):
            return scheduler  # the call computes the shift (`mu`) it needs to try them
        trial = copy.deepcopy(scheduler)
        try:
            trial.set_timesteps(timesteps=list(config.timesteps))
        except ValueError as exc:
            raise ValueError(
                f"timesteps: {type(scheduler).__name__} refuses {list(config.timesteps)}: {exc}"
            ) from exc
    return scheduler


def apply_schedule(pipe: Any, config: PipelineConfig) -> None:
    """Put the configured scheduler in `pipe` (after loading)."""
    if config.scheduler or config.timesteps:
        pipe.scheduler = configured_scheduler(pipe.scheduler, config)


def timesteps_kwargs(config: PipelineConfig) -> dict[str, Any]:
    """The request-level call's fixed timesteps, if configured."""
    return {"timesteps": list(config.timesteps)} if config.timesteps else {}
