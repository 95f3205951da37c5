"""A family's cache-acceleration hooks: which denoisers First-Block Cache hooks and TaylorSeer
skips, and which cache modes a request may choose in step mode.

They are one concern, read only by `pipelines.cache` and the adapter's cache choice, and the
families whose steps differ override them together, so they live apart from the rest of the
contract; `pipelines.families.base.Family` inherits them, and every family reads them there.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

from pipelines.stepping.state import DenoiseState


class CacheHooks:
    """The defaults: the pipeline's transformer (else its UNet) is the denoiser, called once
    per step with every row; TaylorSeer applies to every family that steps."""

    # Set by `Family.__init__`: the hooks read the denoisers from it.
    pipe: DiffusionPipeline

    def cached_denoiser(self) -> torch.nn.Module | None:
        """The transformer whose blocks First-Block Cache skips (`pipelines.cache`), or None
        where it does not apply: diffusers' hooks must work on it (request mode), and the
        family calls it once per step with every row of the group, in `step_together`'s
        order. Step mode takes more (`first_block_steps`, `cached_denoisers`)."""
        return None

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        """Every denoiser a step may call, for step mode's First-Block Cache: the one of
        `cached_denoiser`, or more where a family steps with several (Wan 2.2's experts)."""
        denoiser = self.cached_denoiser()
        return () if denoiser is None else (denoiser,)

    def step_cache_modes(self) -> frozenset[str]:
        """The cache modes a request may choose in step mode, each request deciding for itself
        inside a shared step (`pipelines.cache`)."""
        modes = {"first-block"} if self.first_block_steps() else set()
        if self.taylor_seer_steps():
            modes.add("taylorseer")
        return frozenset(modes)

    def first_block_steps(self) -> bool:
        """Whether First-Block Cache runs per request in this family's shared steps: one
        denoiser whose blocks it hooks, called once per step with every row
        (`cached_denoiser`). Families whose steps differ override this, and say which
        forward each call is (`pipelines.cache.calls.denoiser_call`) and which denoisers
        they call (`cached_denoisers`)."""
        return self.cached_denoiser() is not None

    def taylor_seer_steps(self) -> bool:
        """Whether TaylorSeer runs per request in this family's shared steps: it predicts a
        request's guided output (what its scheduler steps with) and keeps its rows out of the
        step's forwards, so it needs nothing of the denoiser: every family that steps takes
        it (asked in step mode only). A family whose steps cannot leave rows out says no."""
        return True

    def step_denoiser(self, state: DenoiseState) -> torch.nn.Module:
        """The module that computes `state`'s rows at its step: its blocks are what TaylorSeer's
        predicted steps skip, and a request whose module changes (Wan 2.2's experts) starts a
        new series. The transformer, else the UNet."""
        transformer: torch.nn.Module | None = getattr(self.pipe, "transformer", None)
        return transformer if transformer is not None else self.pipe.unet
