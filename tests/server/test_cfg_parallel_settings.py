"""`--cfg-parallel 2`: two workers per lane, each config with its seat (the lead first, both
meeting at one address), devices counted per lane; refused at start in one line where the
lane cannot share steps, and, in the worker, for a family that does not split its guided
rows (`pipelines.parallel.lane_group.refusal`)."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.families.flux import Flux
from pipelines.families.flux_fill import FluxFill
from pipelines.families.sd3 import StableDiffusion3
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.parallel.lane_group import LaneRefusedError, backend_for, refusal
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


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batching": "request"}, "--cfg-parallel 2 needs --batching step"),
        ({"cache": "first-block"}, "cannot go with --cache first-block"),
        ({"executor": "thread"}, "use executor process"),
        ({"device": "cuda:0"}, "does not name one device per worker for 2 workers"),
        ({"controlnet": ["edges=tiny-sd-controlnet"]}, "cannot go with --controlnet"),
        ({"ip_adapter": ["style=tiny-sd-ip-adapter"]}, "cannot go with --ip-adapter"),
    ],
)
def test_what_cannot_share_steps_is_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(None, {"cfg_parallel": 2, **values}, environ={})


class _Adapter:
    """What `refusal` reads of a loaded adapter."""

    def __init__(self, family: type) -> None:
        self.family: Any = object.__new__(family)
        self.row_split = None
        self.supports_step_batch = True


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
