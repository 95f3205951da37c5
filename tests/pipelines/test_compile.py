"""`--compile blocks` on one tiny DiT (FLUX) and one tiny UNet (SD), and `--compile full` on
the DiT: after the warm-up at
start, step groups that grow and shrink as requests join and finish compile nothing more,
and every image is within 1/255 of the uncompiled model's (inductor, as served). Few and
small on purpose: inductor compiles slowly on a shared CPU. Whether a shape recompiles is
decided by torch's guards before any backend runs, so the request-level path's count is
checked with the eager backend."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from engine.request import RequestBatch
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.denoiser.compiling import compiled_graphs
from pipelines.denoiser.options import DenoiserConfig
from pipelines.denoiser.warmup import warm_up
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import mixed_requests, run_interleaved
from tests.threads import THREADS

pytestmark = [
    pytest.mark.slow,
    # Inductor's first import (torch.utils.mkldnn) warns about torch's own TorchScript use.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def loaded(model: str, denoiser: DenoiserConfig | None = None) -> DiffusersAdapter:
    config = PipelineConfig(model=model, num_threads=THREADS, denoiser=denoiser or DenoiserConfig())
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    return pipeline


@pytest.mark.parametrize(
    ("model", "mode"), [("tiny-flux", "blocks"), ("tiny-sd", "blocks"), ("tiny-flux", "full")]
)
def test_compiled_denoisers_match_and_never_recompile_as_step_groups_change(model: str, mode: str) -> None:
    plain = loaded(model)
    compiled = loaded(model, DenoiserConfig(compile=mode))  # type: ignore[arg-type]
    warmed = warm_up(compiled, compiled.config.denoiser)
    assert not warmed.reason and warmed.seconds > 0
    # Guidance on and off, n 1 and 2: groups of 1 to 7 rows (14 with CFG) as they join
    # and leave.
    requests = mixed_requests(plain, random.Random(model))
    joins = [0, 1, 1, 3, 5]
    before = compiled_graphs()
    stepped = run_interleaved(compiled, requests, joins)
    assert compiled_graphs() == before, "a group size the warm-up did not cover recompiled"
    expected = run_interleaved(plain, requests, joins)
    for request in requests:
        got, want = stepped[request.request_id], expected[request.request_id]
        for image, reference in zip(got.images, want.images, strict=True):
            assert difference(image, reference) <= 1, request.params


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd"])
def test_request_level_forwards_of_any_size_do_not_recompile_after_their_warm_up(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_module = torch.nn.Module.compile

    def eager(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        compile_module(self, *args, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", eager)
    compiled = loaded(model, DenoiserConfig(compile="blocks", warmup_batching="request"))
    assert not warm_up(compiled, compiled.config.denoiser).reason
    requests = mixed_requests(compiled, random.Random(model))
    before = compiled_graphs()
    for request in requests:  # n 1 and 2, guidance on and off: 1 to 4 rows
        compiled.forward(RequestBatch(key=(), requests=(request,)))
    twice = [requests[3], requests[3].with_params(dataclasses.replace(requests[3].params, seed=1))]
    compiled.forward(RequestBatch(key=(), requests=tuple(twice)))
    assert compiled_graphs() == before, "a batch size the warm-up did not cover recompiled"
