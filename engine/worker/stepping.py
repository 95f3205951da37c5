"""Running `StepPlan`s through a stepping pipeline, with per-request fate.

The hardware side of step-level batching, run wherever the pipeline lives (the executor
thread): `StepRunner` keeps each running request's denoising state between iterations,
prepares joiners, steps groups and finishes (decodes, together) those that took their
last step — on the stepping thread, or beside it on a decode thread (`engine.worker.decoding`).
The stages themselves, with per-request fate (a group whose stage raises is retried in
halves) and their timing on the device, are `engine.worker.step_stages`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol, TypeVar

from engine.outputs import BatchOutput
from engine.request import PartialImage
from engine.sched.step_plan import StepPlan
from engine.worker.decoding import DecodeOverlap, OverlapPolicy
from engine.worker.step_stages import StageRunner, StepPipeline, StepState

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


# Told each preview as soon as it is decoded (from the thread that steps).
PartialListener = Callable[[PartialImage], None]


class Flag(Protocol):
    """A flag the engine sets on the event loop and the pipeline's side reads while it runs:
    a `threading.Event` in-process, a multiprocessing event for a worker process."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


# A request that took its last step waits at most this many further steps of its group for
# others to finish, so their VAE decodes run together: decoding one image at a time costs
# about twice as much per image (`python -m bench.stage_times --model tiny-qwen-image`), and a
# decode stalls every other request's steps.
MAX_FINISH_WAIT_STEPS = 2


class StepRunner:
    """Runs `StepPlan`s where the pipeline lives, keeping each running request's state.

    `run` frees dropped states, prepares the joiners, then steps the group; while nothing
    changes it keeps stepping the same group here, because going back to the event loop
    after every step would leave the accelerator idle while the loop serves HTTP. It
    returns when requests are finished (decoded), one fails, a stage ran out of memory (a
    step's lowers the step budget, `engine.sched.step_budget`), previews are ready to send, or
    `attention` is set (a request arrived or was aborted), so the engine still acts at the
    next step boundary. Steps are timed on the device (`engine.worker.timing`): their records come
    with the first result after the device has got past them.

    Requests that took their last step are decoded together where that pays: on a model
    whose step costs less than decoding one image (`OverlapPolicy.worth_waiting`), they
    wait up to `MAX_FINISH_WAIT_STEPS` more steps for whoever finishes meanwhile — unless
    nothing else is still stepping, or they are at least as many as those still stepping
    and the rest will not all finish within the wait. Elsewhere (and until a step and a
    decode have been timed) they are decoded at once. With `decode_overlap` ("auto": when
    a decode is expected to take longer than a step) the decode runs on a thread of its
    own while the group goes on stepping;
    its outputs are returned by the first `run` after it is done (one waits for it when
    nothing else is left to step). The pipeline must then allow `finish` beside `step`,
    `prepare` and `preview` (`SteppedStages` serialises its VAE calls).
    """

    def __init__(
        self,
        pipeline: StepPipeline,
        on_partial: PartialListener | None = None,
        decode_overlap: DecodeOverlap = "off",
    ) -> None:
        self.pipeline = pipeline
        self.stages = StageRunner(pipeline)
        # Where previews go as soon as they are decoded; without one they ride in the result
        # and `run` returns early so that they are not held back.
        self.on_partial = on_partial
        self.states: dict[str, StepState] = {}
        # Done denoising, waiting to be decoded with others: steps waited so far.
        self.finishing: dict[str, int] = {}
        self.policy = OverlapPolicy(decode_overlap)
        self._decoder: ThreadPoolExecutor | None = None
        # Decodes running beside the steps; each ends as a BatchOutput of its own.
        self._decoding: set[Future[BatchOutput]] = set()
        # Which decode owns each request decoded beside: a request dropped meanwhile, or
        # joined again under its id, leaves it, and that decode's output for it is stale.
        self._beside: dict[str, Future[BatchOutput]] = {}
        self.decodes_beside = 0
        # The pipeline's count of halved decodes when the last result was returned.
        self._decodes_halved = pipeline.decode_out_of_memory()

    def run(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        result = BatchOutput()
        for request_id in plan.drop:
            self.states.pop(request_id, None)
            self.finishing.pop(request_id, None)
            self._beside.pop(request_id, None)
        for request in plan.join:
            self._beside.pop(request.request_id, None)
        if plan.join:
            self.stages.prepare(self.states, list(plan.join), result)
        while True:
            stepping = self._stepping(plan)
            if stepping:
                self._step(stepping, result)
            done = [rid for rid in plan.step if rid in self.finishing and rid in self.states]
            still = self._stepping(plan)
            if done and self._decode_now(done, still):
                for request_id in done:
                    self.finishing.pop(request_id, None)
                if not self._decode_beside(done, result):
                    self._decode_here(done, result)
                    return self._ending(result)
            else:
                for request_id in done:
                    self.finishing[request_id] += 1
            if self._collect(result, block=not still):
                return self._ending(result)
            # News for the engine: errors, previews, memory that ran out (a step's lowers the
            # budget; every one is counted).
            news = result.errors or result.partials or any(fit.out_of_memory for fit in result.fits)
            if not still or news or attention is None or attention.is_set():
                return self._ending(result)

    def _ending(self, result: BatchOutput) -> BatchOutput:
        """`result`, with the steps' times the device has got past; all of them when nothing
        is left to run here (waiting for the device then stalls nothing), else the rest come
        with a later result."""
        idle = not self.states and not self._decoding
        self._read_times(result, wait=idle)
        halved = self.pipeline.decode_out_of_memory()
        result.decode_out_of_memory += halved - self._decodes_halved
        self._decodes_halved = halved
        result.prompt_cache = self.pipeline.prompt_cache_counts()
        return result

    def _read_times(self, result: BatchOutput, *, wait: bool) -> None:
        self.stages.read_times(self.states, result, wait=wait, observe=self.policy.observe_step)
        # A request that failed there (a device error) may have been waiting for company.
        for request_id in [rid for rid in self.finishing if rid not in self.states]:
            del self.finishing[request_id]

    def _step(self, group: list[str], result: BatchOutput) -> None:
        # While a decode runs beside, it shares the device (the default CUDA stream, or the
        # host's cores): this step's time holds some of its work, so it is not learnt from.
        self.stages.step(self.states, group, result, shared=bool(self._decoding))
        # Asks without waiting: the device may still be running this step and the last.
        self._read_times(result, wait=False)
        self._send_previews(group, result)
        for request_id in group:
            state = self.states.get(request_id)
            if state is not None and state.is_done:
                self.finishing[request_id] = 0

    def close(self) -> None:
        """Wait for decodes running beside the steps (their outputs are dropped) and stop
        the decode thread."""
        if self._decoder is not None:
            self._decoder.shutdown(wait=True, cancel_futures=True)
            self._decoder = None

    def _decode_here(self, ids: list[str], result: BatchOutput) -> None:
        images = sum(self.states[rid].num_images for rid in ids)
        self.policy.observe_decode(images, self.stages.decode(self.states, ids, result, beside=False))
        # The decode brought images to the host: the device is past every step before it.
        self._read_times(result, wait=True)

    def _decode_beside(self, ids: list[str], result: BatchOutput) -> bool:
        """Start decoding `ids` on the decode thread if the policy says so; their states
        leave `states` (the decode thread owns them now) and `result.decoding` tells the
        engine, which gives their share of the steps to others."""
        images = sum(self.states[rid].num_images for rid in ids)
        if not self.policy.overlap(images):
            return False
        if self._decoder is None:
            logger.info("decoding finished requests beside the steps (decode_overlap %s)", self.policy.mode)
            self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffbatch-decode")
        self.decodes_beside += 1
        owned = {rid: self.states.pop(rid) for rid in ids}

        def decode() -> BatchOutput:
            # Its time holds the steps that ran meanwhile (they share the device), so the
            # policy does not learn from it: it would make decodes look dearer than they
            # are and keep `auto` decoding beside. Decodes on the stepping thread teach it.
            output = BatchOutput()
            self.stages.decode(owned, ids, output, beside=True)
            return output

        future = self._decoder.submit(decode)
        self._decoding.add(future)
        self._beside.update(dict.fromkeys(ids, future))
        result.decoding.extend(ids)
        return True

    def _collect(self, result: BatchOutput, *, block: bool) -> bool:
        """Move finished decodes' outputs into `result` (with `block`, wait for one first if
        any is running); True if there were any."""
        if not self._decoding:
            return False
        if block:
            wait(self._decoding, return_when=FIRST_COMPLETED)
        ready = [future for future in self._decoding if future.done()]
        for future in ready:
            self._decoding.discard(future)
            output = future.result()
            result.outputs.update(self._still_owned(future, output.outputs))
            result.errors.update(self._still_owned(future, output.errors))
            result.decodes.extend(output.decodes)
            result.fits.extend(output.fits)
            result.moderations.extend(output.moderations)
        return bool(ready)

    def _still_owned(self, future: Future[BatchOutput], ended: dict[str, _T]) -> dict[str, _T]:
        """What `future`'s decode ended of the requests it still owns: not those dropped
        meanwhile, nor a newer request under the same id (it would end that one)."""
        owned = {rid: what for rid, what in ended.items() if self._beside.get(rid) is future}
        for request_id in owned:
            del self._beside[request_id]
        return owned

    def _send_previews(self, group: list[str], result: BatchOutput) -> None:
        partials = self.stages.preview(self.states, group, result)
        for partial in partials:
            if self.on_partial is not None:
                self.on_partial(partial)
            else:
                result.partials.append(partial)
        if partials:  # decoded to the host: the device is past the steps before them
            self._read_times(result, wait=True)

    def _stepping(self, plan: StepPlan) -> list[str]:
        return [rid for rid in plan.step if rid in self.states and rid not in self.finishing]

    def _decode_now(self, done: list[str], still: list[str]) -> bool:
        waited = max(self.finishing[rid] for rid in done)
        if not still or waited >= MAX_FINISH_WAIT_STEPS:
            return True
        if not self.policy.worth_waiting(1):
            # A step costs more than decoding an image alone (tiny-sd: a step of 8 about 20
            # decodes of one): waiting for company would cost more latency than it saves.
            return True
        # The rest of the group finishes within the wait, cheaply: decode everyone then, so
        # no straggler is decoded alone (which would stall the next group's steps).
        left = max(self.states[rid].total_steps - self.states[rid].steps_done for rid in still)
        if waited + left <= MAX_FINISH_WAIT_STEPS and self.policy.worth_waiting(left):
            return False
        return len(done) >= len(still)
