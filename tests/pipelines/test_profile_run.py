"""The profile run through the real engine start (`AsyncEngine.start` → the executor's
`measure_loaded` → tiny-sd's own step stages), on the CPU with a fake gauge that reports
memory proportional to the rows each component is called with (`profile_gauge.RowsGauge`):
the budgets it lowers are the engine's and the pipeline's from then on, in a thread and in
a worker process."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.abstract import Executor
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, SamplingParams
from engine.worker.profile_run import ProfilePlan
from pipelines.base import PipelineConfig
from server.composition import process_executor, thread_executor
from tests.pipelines.profile_gauge import RowsGauge

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["thread", "process"])
async def test_the_profile_run_lowers_the_engines_and_the_decodes_budgets(kind: str) -> None:
    config = PipelineConfig(model="tiny-sd", num_threads=1)
    # 8 requests (16 rows with guidance) run out of the fake 100 MiB; 4 hold 80 of the 90
    # allowed. A decode of those 4 images runs out (120); of 2, holds 60.
    plan = ProfilePlan("on", utilization=0.9, max_num_seqs=8, gauge=RowsGauge)
    executor: Executor = (
        thread_executor(config, profile=plan) if kind == "thread" else process_executor(config, profile=plan)
    )
    engine = AsyncEngine(executor, EngineConfig(max_num_seqs=8, batching="step"))
    await engine.start()
    try:
        profile = engine.profile
        assert profile is not None and profile.state == "measured", profile
        spec = engine.spec
        assert spec is not None
        request = GenerationRequest.create("x", SamplingParams())
        request = request.with_params(spec.resolve(request))
        cost = spec.step_cost(request)
        width, height = request.params.width or 0, request.params.height or 0
        assert (profile.max_num_seqs, profile.max_step_tokens) == (4, 4 * cost)
        assert (profile.step_peak, profile.decode_peak) == (80 * 2**20, 60 * 2**20)
        assert profile.decode_budget == 2 * width * height
        assert engine.config.max_num_seqs == 4
        steps = engine.lanes[0].steps
        assert steps is not None and steps.max_step_cost == 4 * cost
        if isinstance(executor, ThreadExecutor):
            pipe = executor._pipeline.pipe  # type: ignore[union-attr]
            assert pipe.vae.decode.limit.pixels == 2 * width * height
        output = await engine.generate(
            GenerationRequest.create("a red cat", SamplingParams(num_inference_steps=2, seed=1))
        )
        assert len(output.images) == 1
    finally:
        await engine.stop()


def test_the_cuda_gauge_frees_the_cache_before_each_run() -> None:
    """After a run that ran out of memory the allocator's cache still holds what it
    reserved; without `empty_cache` every smaller run's reserved peak would start there and
    the search would halve down to a budget of 1 (no GPU here: a fake `torch.cuda`)."""
    from types import SimpleNamespace

    from pipelines.memory.gauge import CudaGauge

    calls: list[str] = []
    cuda = SimpleNamespace(
        synchronize=lambda device: calls.append("synchronize"),
        empty_cache=lambda: calls.append("empty_cache"),
        reset_peak_memory_stats=lambda device: calls.append("reset"),
    )
    gauge = CudaGauge("cuda:0")
    gauge.torch = SimpleNamespace(cuda=cuda)  # type: ignore[assignment]
    gauge.reset_peak()
    assert calls == ["synchronize", "empty_cache", "reset"]
