"""`--cfg-parallel 2` and `--sequence-parallel N`: the workers of each lane, each config with
its seat (the lead first, all meeting at one address), devices counted per lane; refused at
start in one line where the lane cannot share steps, and, in the worker, for a family that
does not split its guided rows (`pipelines.parallel.lane_group.refusal`) or its tokens
(`pipelines.parallel.sequence.refusal`)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipelines.base import PipelineConfig
from pipelines.families.flux import Flux
from pipelines.families.flux_fill import FluxFill
from pipelines.families.ltx import LTX
from pipelines.families.qwen_image import QwenImage
from pipelines.families.sd3 import StableDiffusion3
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.parallel import sequence
from pipelines.parallel.lane_group import LaneRefusedError, backend_for, refusal
from pipelines.parallel.seat import LaneShape
from server.settings import SettingsError, load_settings


def test_each_lane_is_two_workers_with_their_seats_and_devices() -> None:
    settings = load_settings(
        None, {"cfg_parallel": 2, "data_parallel_size": 2, "device": "cuda", "batching": "step"}, environ={}
    )
    lanes = settings.lane_configs()
    assert [[c.device for c in lane] for lane in lanes] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    for lane in lanes:
        seats = [config.lane for config in lane]
        assert [seat.rank for seat in seats if seat] == [0, 1] and len({s.address for s in seats if s}) == 1
    assert lanes[0][0].lane != lanes[1][0].lane  # each lane meets apart
    assert settings.executor_kind == "process"
    assert backend_for("cuda:1") == "nccl" and backend_for("cpu") == "gloo"


@pytest.mark.parametrize("cache", ["first-block", "taylorseer"])
def test_a_lane_takes_the_step_caches(cache: str) -> None:
    """Each request decides over all its rows and tokens, whichever worker holds them
    (`pipelines.parallel.lane_split`); a family that cannot is refused at its start."""
    for lane in ({"cfg_parallel": 2}, {"sequence_parallel": 2}, {"cfg_parallel": 2, "sequence_parallel": 2}):
        assert load_settings(None, {**lane, "cache": cache}, environ={}).cache == cache


class _Denoiser(torch.nn.Module):
    """Two transformer blocks and a context-parallel plan."""

    def __init__(self, plan: dict[str, Any]) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)])
        self._cp_plan = plan


@pytest.mark.parametrize(
    ("plan", "refused"),
    [
        ({"": {}, "proj_out": {}}, False),  # FLUX's, LTX's: the inputs cut before every block
        ({"transformer_blocks.0": {}, "proj_out": {}}, True),  # Qwen-Image's, Wan's
    ],
)
def test_first_block_cache_with_split_tokens_needs_them_cut_before_the_first_block(
    plan: dict[str, Any], refused: bool
) -> None:
    said = sequence.first_block_refusal([_Denoiser(plan)])
    assert (said is not None) == refused
    assert said is None or "cuts its tokens at its first block's entry" in said


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batching": "request"}, "--cfg-parallel 2 needs --batching step"),
        ({"executor": "thread"}, "use executor process"),
        ({"device": "cuda:0"}, "does not name one device per worker for 2 workers"),
        ({"ip_adapter": ["style=tiny-sd-ip-adapter"]}, "cannot go with --ip-adapter"),
        (
            {"controlnet": ["edges=tiny-sd-controlnet"], "sequence_parallel": 2},
            "--cfg-parallel 2 --sequence-parallel 2 cannot go with --controlnet",
        ),
        # On Ray Serve each worker is a placement group bundle: a whole GPU, or some CPU.
        ({"device": "cuda", "replica_gpus": 0.5}, "asks one GPU per worker"),
        ({"replica_cpus": 0}, "which cannot be empty"),
    ],
)
def test_what_cannot_share_steps_is_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(None, {"cfg_parallel": 2, **values}, environ={})


class _Adapter:
    """What `refusal` reads of a loaded adapter."""

    def __init__(self, family: type, controlnets: tuple[tuple[str, str], ...] = ()) -> None:
        self.family: Any = object.__new__(family)
        self.row_split = None
        self.supports_step_batch = True
        self.config = PipelineConfig(model="m", controlnets=controlnets)


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        (StableDiffusion, None),
        (Flux, None),
        (FluxFill, "guidance-distilled"),
        (StableDiffusion3, "does not split its guided rows between devices yet"),
    ],
)
def test_a_family_that_does_not_split_its_guided_rows_is_refused(family: type, reason: str | None) -> None:
    said = refusal(_Adapter(family))
    assert said is None if reason is None else reason in (said or "")
    if said is not None:
        assert str(LaneRefusedError(said)).startswith("--cfg-parallel: ")


def test_controlnets_split_with_the_guided_rows_where_the_family_says_so() -> None:
    """Stable Diffusion's ControlNet runs on each branch's rows with their own text; FLUX's
    steers the positive rows and reuses their residuals for the negative ones, which the
    lane's other device runs (11-12/255 off when tried)."""
    controlnets = (("edges", "tiny-sd-controlnet"),)
    assert refusal(_Adapter(StableDiffusion, controlnets)) is None
    said = refusal(_Adapter(Flux, controlnets)) or ""
    assert "does not split its ControlNets' rows between devices yet" in said
    settings = load_settings(
        None, {"cfg_parallel": 2, "controlnet": ["edges=tiny-sd-controlnet"]}, environ={}
    )
    assert settings.pipeline_config().controlnets == controlnets


# Sequence parallelism (`--sequence-parallel`, `pipelines.parallel.sequence`) ------------------


def test_a_lane_of_two_cfg_shares_of_two_token_shares_is_four_workers() -> None:
    values = {"cfg_parallel": 2, "sequence_parallel": 2, "data_parallel_size": 2, "device": "cuda"}
    settings = load_settings(None, values, environ={})
    lanes = settings.lane_configs()
    assert [[c.device for c in lane] for lane in lanes] == [
        [f"cuda:{i}" for i in range(j, j + 4)] for j in (0, 4)
    ]
    seats = [config.lane for config in lanes[0]]
    assert all(seat is not None for seat in seats)
    assert [(s.rank, s.cfg_rank) for s in seats if s] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert {s.shape for s in seats if s} == {LaneShape(cfg=2, sequence=2, mode="ulysses")}
    cpu = load_settings(None, {"sequence_parallel": 2, "num_threads": 4}, environ={})
    assert [c.num_threads for c in cpu.worker_configs()] == [2, 2] and cpu.executor_kind == "process"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batching": "request"}, "--sequence-parallel 2 needs --batching step"),
        ({"sp_mode": "ring", "device": "cuda"}, "--attention-backend native: diffusers 0.42.1 runs ring"),
        ({"sp_mode": "ring", "attention_backend": "math"}, "runs ring attention with native on the CPU"),
        ({"attention_backend": "math"}, "runs ulysses attention with native on the CPU"),
        (
            {"attention_backend": "math", "device": "cuda"},
            "runs ulysses attention with native, cudnn, flash, sage",
        ),
    ],
)
def test_what_cannot_split_tokens_is_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(None, {"sequence_parallel": 2, **values}, environ={})


def test_ring_on_cuda_with_a_backend_that_returns_its_log_sum_exp_is_served() -> None:
    values = {"sequence_parallel": 2, "sp_mode": "ring", "device": "cuda", "attention_backend": "cudnn"}
    assert load_settings(None, values, environ={}).lane_shape == LaneShape(1, 2, "ring")


@pytest.mark.parametrize("mode", ["blocks", "full"])
def test_a_compiled_denoiser_splits_its_tokens(mode: str) -> None:
    # Warmed up once the lane is joined (`server.composition.load_configured`).
    settings = load_settings(None, {"sequence_parallel": 2, "compile": mode}, environ={})
    assert settings.pipeline_config().denoiser.compile == mode and settings.lane_shape.sequence == 2


def test_ring_on_the_cpu_is_served_with_the_native_backend() -> None:
    # Its log-sum-exp from `pipelines.parallel.ring_cpu`.
    settings = load_settings(None, {"sequence_parallel": 2, "sp_mode": "ring", "cfg_parallel": 2}, environ={})
    assert settings.lane_shape == LaneShape(2, 2, "ring") and settings.worker_devices() == ["cpu"] * 4


def _tiny_flux_transformer(heads: int) -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=heads,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )


@pytest.mark.parametrize(
    ("family", "denoiser", "shape", "reason"),
    [
        (Flux, "flux-2-heads", LaneShape(sequence=2), None),
        (Flux, "flux-3-heads", LaneShape(sequence=2), "has 3, not a multiple of 2"),
        (Flux, "flux-3-heads", LaneShape(sequence=2, mode="ring"), None),  # ring splits no heads
        (FluxFill, "flux-2-heads", LaneShape(sequence=2), "FluxFill does not split its tokens"),
        (StableDiffusion, "unet", LaneShape(sequence=2), "Linear has no context-parallel plan"),
    ],
)
def test_a_family_whose_denoiser_has_no_plan_or_is_not_verified_is_refused(
    family: type, denoiser: str, shape: LaneShape, reason: str | None
) -> None:
    adapter = _Adapter(family)
    module = (
        _tiny_flux_transformer(int(denoiser[5])) if denoiser.startswith("flux") else torch.nn.Linear(1, 1)
    )
    adapter.family.pipe = SimpleNamespace(**{"unet" if denoiser == "unet" else "transformer": module})
    said = sequence.refusal(adapter, shape)
    assert said is None if reason is None else reason in (said or "")
    if said is not None:
        assert str(LaneRefusedError(said, sequence.FLAG)).startswith("--sequence-parallel: ")


def _tiny_masked_transformer(name: str) -> Any:
    from diffusers import LTXVideoTransformer3DModel, QwenImageTransformer2DModel

    if name == "qwen":
        return QwenImageTransformer2DModel(
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=8,
            axes_dims_rope=(2, 2, 4),
        )
    return LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=8,
    )


@pytest.mark.parametrize(
    ("family", "denoiser", "mask"),
    [(QwenImage, "qwen", "encoder_hidden_states_mask"), (LTX, "ltx", "encoder_attention_mask")],
)
def test_ring_is_refused_where_the_plan_cuts_an_attention_mask(
    family: type, denoiser: str, mask: str
) -> None:
    # diffusers 0.42.1's ring would hide every device's keys by this device's share of the
    # mask (its Ulysses gathers the whole one): Ulysses only.
    adapter = _Adapter(family)
    adapter.family.pipe = SimpleNamespace(transformer=_tiny_masked_transformer(denoiser))
    assert sequence.refusal(adapter, LaneShape(sequence=2)) is None
    said = sequence.refusal(adapter, LaneShape(sequence=2, mode="ring")) or ""
    assert f"ring attention cannot take {type(adapter.family.pipe.transformer).__name__}'s {mask}" in said
    assert said.endswith("use --sp-mode ulysses")
