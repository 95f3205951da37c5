"""The scheduler: which waiting requests run together next.

Pure and synchronous: no I/O, no event loop, no torch, no clock of its own (callers pass
`now`), so its tests build requests by hand and run in milliseconds.

Policy: the first waiting request chooses the `BatchKey`; every waiting request with that
key joins in turn while the batch's images stay within `max_num_seqs`. Requests with
another key are skipped, not waited on, so an incompatible head never blocks compatible
requests behind it. "First" and "in turn" are by priority, then age (`engine.sched.priority`):
arrival order when all share one priority; aging bounds how long a request of a worse
priority is passed over, so nothing starves. Among requests of one priority, senders
(API keys) take turns by fair share (`engine.sched.fair_share`), so one sender's burst does not
starve another's trickle; with one sender the order is arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import DuplicateRequestError
from engine.outputs import ForwardRecord, fitting_images
from engine.request import BatchKey, GenerationRequest, RequestBatch
from engine.sched.fair_share import FairShare
from engine.sched.priority import DEFAULT_AGING_S, by_priority, check_aging_s

# Forwards at a learnt memory cap that must fit before it rises by one image.
RAISE_CAP_AFTER = 20


@dataclass(slots=True)
class _Waiting:
    request: GenerationRequest
    key: BatchKey


class Scheduler:
    """Holds waiting and running requests and forms batches.

    `max_num_seqs` bounds the images of one batch (a request counts its `n`); a request
    whose `n` alone exceeds it still runs, alone. `max_batch_requests=1` gives one
    forward per request, for pipelines that do not support request batching. `aging_s`:
    seconds of waiting that improve a request's priority by one level.
    """

    def __init__(
        self, max_num_seqs: int, max_batch_requests: int | None = None, aging_s: float = DEFAULT_AGING_S
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_batch_requests is not None and max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {max_batch_requests}")
        check_aging_s(aging_s)
        self.max_num_seqs = max_num_seqs
        self.max_batch_requests = max_batch_requests
        self.aging_s = aging_s
        # Dicts keep insertion order, which is arrival order at admission.
        self._waiting: dict[str, _Waiting] = {}
        self._running: dict[str, GenerationRequest] = {}
        # Each sender's share so far; moves as requests join batches.
        self.fair_share = FairShare()
        # Learnt limits: batches of these keys ran out of memory above this many images.
        self._image_caps: dict[BatchKey, int] = {}
        self._successes_at_cap: dict[BatchKey, int] = {}

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return dict(self._image_caps)

    def cap_images(self, key: BatchKey, images: int) -> int:
        """From now on, batches with `key` hold at most `images` images (at least 1; a lower
        cap than an earlier one wins). Returns the cap in force."""
        cap = max(1, min(images, self._image_caps.get(key, images)))
        self._image_caps[key] = cap
        self._successes_at_cap[key] = 0
        return cap

    def record_success(self, key: BatchKey, images: int) -> int | None:
        """A forward of `images` images with `key` fitted. After `RAISE_CAP_AFTER` such
        forwards at its cap, the cap rises by one image (memory may have been short only
        for a while: another process, fragmentation), until it is gone. Returns a new cap."""
        cap = self._image_caps.get(key)
        if cap is None or images < cap:
            return None
        successes = self._successes_at_cap.get(key, 0) + 1
        if successes < RAISE_CAP_AFTER:
            self._successes_at_cap[key] = successes
            return None
        self._successes_at_cap[key] = 0
        if cap + 1 >= self.max_num_seqs:
            del self._image_caps[key]
            return self.max_num_seqs
        self._image_caps[key] = cap + 1
        return cap + 1

    def learn_memory(self, key: BatchKey, forwards: list[ForwardRecord]) -> tuple[bool, str] | None:
        """Learn from a batch's forwards: cap its key if one ran out of memory, count the
        ones that fitted at a cap. Returns (whether it ran out, what changed), or None."""
        fits = fitting_images(forwards)
        if fits is not None:
            images = max(f.num_images for f in forwards)
            cap = self.cap_images(key, fits)
            return (
                True,
                f"out of memory with {images} images of one shape; batches of it now hold {cap} at most",
            )
        for record in forwards:
            raised = self.record_success(key, record.num_images) if record.ok else None
            if raised is not None:
                return False, f"batches of one shape may hold {raised} images again"
        return None

    def image_limit(self, key: BatchKey) -> int:
        return min(self.max_num_seqs, self._image_caps.get(key, self.max_num_seqs))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._running

    def is_running(self, request_id: str) -> bool:
        """Whether `request_id` runs now (admission by deadline counts its steps left)."""
        return request_id in self._running

    def add(self, request: GenerationRequest, key: BatchKey) -> None:
        if self.has_request(request.request_id):
            raise DuplicateRequestError(request.request_id)
        self._waiting[request.request_id] = _Waiting(request, key)

    def abort(self, request_id: str) -> bool:
        """Forget a request. True if it was waiting (so it will never run).

        A running request is forgotten too, and `finish` will not report it as finished;
        the caller drops its result.
        """
        if self._waiting.pop(request_id, None) is not None:
            return True
        self._running.pop(request_id, None)
        return False

    def next_batch(self) -> RequestBatch | None:
        """Move the next batch from waiting to running, or return None if none waits."""
        selected = self._select()
        if not selected:
            return None
        for waiting in selected:
            del self._waiting[waiting.request.request_id]
            self._running[waiting.request.request_id] = waiting.request
            self.fair_share.admitted(waiting.request)
        return RequestBatch(key=selected[0].key, requests=tuple(w.request for w in selected))

    def finish(self, batch: RequestBatch) -> list[str]:
        """Mark a batch done; returns the ids still owed a result (not aborted meanwhile)."""
        return [rid for rid in batch.request_ids if self._running.pop(rid, None) is not None]

    def head_batch_is_full(self) -> bool:
        """Whether the batch `next_batch` would form now cannot grow any more."""
        selected = self._select()
        if not selected:
            return False
        if self.max_batch_requests is not None and len(selected) >= self.max_batch_requests:
            return True
        return sum(w.request.params.n for w in selected) >= self.image_limit(selected[0].key)

    def head_last_arrival(self) -> float | None:
        """Arrival time of the newest waiting request compatible with the head (the one
        served first)."""
        head = next(iter(self._in_turn()), None)
        if head is None:
            return None
        return max(w.request.arrival_time for w in self._waiting.values() if w.key == head.key)

    def head_arrival(self) -> float | None:
        head = next(iter(self._in_turn()), None)
        return None if head is None else head.request.arrival_time

    def waiting_before(self, request: GenerationRequest, key: BatchKey) -> list[GenerationRequest]:
        """The waiting requests served before `request` were it added now (admission by
        deadline counts their steps)."""
        probe = _Waiting(request, key)
        ordered = self._in_turn([*self._waiting.values(), probe])
        return [w.request for w in ordered[: next(i for i, w in enumerate(ordered) if w is probe)]]

    def _in_turn(self, waiting: list[_Waiting] | None = None) -> list[_Waiting]:
        """The waiting requests (`waiting`: those waiting now) in the order they are served."""
        listed = list(self._waiting.values()) if waiting is None else waiting
        ordered = by_priority(listed, lambda w: w.request, self.aging_s)
        return self.fair_share.order(ordered, lambda w: w.request)

    def _select(self) -> list[_Waiting]:
        waiting = iter(self._in_turn())
        head = next(waiting, None)
        if head is None:
            return []
        selected = [head]
        images = head.request.params.n
        limit = self.image_limit(head.key)
        for candidate in waiting:
            if self.max_batch_requests is not None and len(selected) >= self.max_batch_requests:
                break
            if images >= limit:
                break
            if candidate.key != head.key:
                continue
            n = candidate.request.params.n
            if images + n > limit:
                # A smaller compatible request further back may still fit.
                continue
            selected.append(candidate)
            images += n
        return selected
