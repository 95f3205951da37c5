"""The `diffusers` contender: the served model's own diffusers pipeline, called as its users
call it — `pipe(prompt=[...], generator=[...], num_inference_steps=...)` — with the same
batches as `direct` (`bench.direct`). It measures what the adapter costs over diffusers:
`direct ÷ diffusers` and `direct-step ÷ diffusers` (`bench.report.round_ratios`).

Text-to-image only: each request's prompt, repeated for its `n` images, each image with a
CPU generator seeded as the server seeds it (`SamplingParams.image_seeds`), its size, and its
negative prompt and guidance where the request sets them (diffusers' defaults otherwise:
the adapter's defaults for a family may differ, which the ratio then includes).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from bench.direct import BatchRun, DirectContender


class DiffusersContender(DirectContender):
    """`pipeline.pipe` called with whole batches, beside the adapter it is loaded in."""

    def __init__(self, pipeline: Any, max_num_seqs: int, *, flush_denormal: bool = True) -> None:
        if pipeline.modality != "image" or pipeline.input_image_count[0] > 0:
            raise ValueError("the diffusers contender calls text-to-image pipelines only")
        super().__init__(pipeline, max_num_seqs, "diffusers", flush_denormal=flush_denormal)

    def run_batch(self, batch: Any) -> BatchRun:
        import torch

        from pipelines.outputs import to_arrays

        pipe = self.pipeline.pipe
        takes = inspect.signature(pipe.__call__).parameters
        prompts, negatives, generators, owners = [], [], [], []
        for request in batch.requests:
            for seed in request.params.image_seeds():
                prompts.append(request.prompt)
                negatives.append(request.params.negative_prompt or "")
                generators.append(torch.Generator("cpu").manual_seed(seed))
                owners.append(request.request_id)
        params = batch.requests[0].params  # the batch key holds size, steps and guidance
        kwargs: dict[str, Any] = {"width": params.width, "height": params.height}
        if any(negatives):
            kwargs["negative_prompt"] = negatives
        if params.guidance_scale is not None and "guidance_scale" in takes:
            kwargs["guidance_scale"] = params.guidance_scale
        run = BatchRun(0.0)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                result = pipe(
                    prompt=prompts,
                    generator=generators,
                    num_inference_steps=params.num_inference_steps,
                    output_type="np",
                    **kwargs,
                )
            # Uint8 as the adapter hands its images back: its time includes the same work.
            for owner, image in zip(owners, to_arrays(result.images, "np"), strict=True):
                run.images.setdefault(owner, []).append(image)
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets it
            run.errors = {r.request_id: f"{type(exc).__name__}: {exc}" for r in batch.requests}
        run.seconds = time.perf_counter() - start
        return run
