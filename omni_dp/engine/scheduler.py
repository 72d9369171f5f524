"""Continuous batching over the paged KV pool.

The scheduler owns the requests, the waiting and running queues and the page allocator; the
model runner only ever sees what `schedule()` hands it. Each step gives every scheduled request
the tokens it still needs to compute (its whole sequence after admission or preemption, one token
while decoding). There is no separate prefill and decode phase.

Shortage policy: running requests go first, oldest first. When one needs a page and none is free,
the newest running request is preempted: its pages are freed, it goes back to the head of the
queue with its output kept, and its keys/values are recomputed when it is admitted again. No
request ever fails for lack of pages; one that could not fit even alone is refused at admission.

Admission order: the waiting requests are kept in one FIFO queue per priority class
(engine/priority.py); each free slot of the running batch goes to the class PriorityPolicy
selects (the highest that waits, with 1 turn in every --priority-share-every to the longest
waiting lower class). Each request's first wait in the queue, from its arrival here to its
first admission, is counted per class for /metrics (omni_dp_queue_wait_seconds).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from omni_dp.contract import Priority
from omni_dp.engine.kv_cache import KVCacheSpec, PageAllocator
from omni_dp.engine.options import DEFAULT_PRIORITY_SHARE_EVERY
from omni_dp.engine.priority import PriorityPolicy, QueueWaits


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # sampled end-of-audio
    FINISHED_LENGTH = 3  # reached max_new_tokens
    FINISHED_ABORTED = 4  # client went away or the server is stopping

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class AdmissionError(ValueError):
    """A request that can never be served by this replica (HTTP 400)."""


_arrival_counter = itertools.count()


@dataclass(eq=False)
class TalkerRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    first_code_id: int  # codec code c enters the sequence as token first_code_id + c
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    output_codes: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    priority: Priority = Priority.DEFAULT  # its class: the order it is admitted in
    queued_at: float | None = None  # time.monotonic() of its arrival here, until first admitted

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_codes)

    def token_ids(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        ids = self.prompt_ids[start : min(end, n_prompt)]
        if end > n_prompt:
            codes = self.output_codes[max(start - n_prompt, 0) : end - n_prompt]
            ids += [self.first_code_id + c for c in codes]
        return ids


@dataclass
class ScheduledRequest:
    request: TalkerRequest
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestOutput:
    """What one step produced for one request: a new code, and whether it is done."""

    request_id: str
    new_code: int | None
    status: RequestStatus


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_total: int
    num_preemptions_total: int
    num_generated_tokens_total: int
    # by priority class (engine/priority.py): requests waiting now, and the histogram of each
    # request's first wait (priority.QueueWaits: per-bucket counts, sum in seconds)
    queue_depth: dict[str, int] = field(default_factory=dict)
    queue_wait_counts: dict[str, list[int]] = field(default_factory=dict)
    queue_wait_sum: dict[str, float] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        kv_spec: KVCacheSpec,
        *,
        end_of_audio: int,
        max_running_requests: int,
        max_prefill_tokens: int = 4096,
        priority_share_every: int = DEFAULT_PRIORITY_SHARE_EVERY,
    ) -> None:
        """`priority_share_every`: --priority-share-every (engine/priority.py)."""
        self.kv_spec = kv_spec
        self.end_of_audio = end_of_audio  # the talker output index that ends a request
        self.allocator = PageAllocator(kv_spec.num_pages)
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.queues: dict[Priority, deque[TalkerRequest]] = {p: deque() for p in Priority}
        self.policy = PriorityPolicy(priority_share_every)
        self.queue_waits = QueueWaits()
        self.running: list[TalkerRequest] = []  # kept in arrival order: oldest first
        self.requests: dict[str, TalkerRequest] = {}
        self.num_preemptions_total = 0
        self.num_generated_tokens_total = 0

    # --- requests in and out -----------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        need = num_prompt_tokens + max_new_tokens - 1  # the last code is never fed back
        if need > self.kv_spec.max_total_tokens:
            raise AdmissionError(
                f"request needs {need} KV tokens ({num_prompt_tokens} prompt + "
                f"{max_new_tokens} new - 1) but the whole pool holds "
                f"{self.kv_spec.max_total_tokens}; shorten the input or lower max_new_tokens"
            )

    def add_request(self, request: TalkerRequest) -> None:
        self.check_admissible(len(request.prompt_ids), request.max_new_tokens)
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        request.queued_at = time.monotonic()
        self.queues[request.priority].append(request)

    @property
    def waiting(self) -> list[TalkerRequest]:
        """Every waiting request: by class, highest first, each class oldest first."""
        return [request for queue in self.queues.values() for request in queue]

    def abort_request(self, request_id: str) -> TalkerRequest | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.queues[request.priority].remove(request)
        self._free_pages(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def has_requests(self) -> bool:
        return bool(self.running) or any(self.queues.values())

    def stats(self) -> SchedulerStats:
        wait_counts, wait_sums = self.queue_waits.snapshot()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_pages_used=self.allocator.num_used,
            num_pages_total=self.allocator.num_pages,
            num_preemptions_total=self.num_preemptions_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
            queue_depth={p.label: len(queue) for p, queue in self.queues.items()},
            queue_wait_counts=wait_counts,
            queue_wait_sum=wait_sums,
        )

    # --- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older request
            if not self._grow_to(request, request.num_tokens, preempted):
                continue  # it was the newest and had to preempt itself
            scheduled.append(
                ScheduledRequest(request, request.num_tokens - request.num_computed_tokens)
            )

        # No admission in a step that had to preempt: the pool is already short.
        if not preempted:
            prefill_budget = self.max_prefill_tokens
            while len(self.running) < self.max_running_requests:
                heads = {p: queue[0].arrival for p, queue in self.queues.items() if queue}
                chosen = self.policy.select(heads)
                if chosen is None:
                    break
                request = self.queues[chosen][0]
                num_new = request.num_tokens  # everything: fresh, or recomputed after preemption
                if num_new > prefill_budget and prefill_budget < self.max_prefill_tokens:
                    break  # over this step's budget; one long prompt alone is always allowed
                pages = self.allocator.allocate(self.kv_spec.pages_for(num_new))
                if pages is None:
                    break
                self.queues[chosen].popleft()
                self.policy.dispatched(heads, chosen)
                self._count_wait(request)
                request.pages = pages
                request.num_computed_tokens = 0
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=lambda r: r.arrival)
                scheduled.append(ScheduledRequest(request, num_new))
                prefill_budget -= num_new

        assert len(self.running) <= self.max_running_requests
        return SchedulerOutput(scheduled, preempted)

    def update_from_output(
        self, output: SchedulerOutput, sampled_codes: list[int]
    ) -> list[RequestOutput]:
        """Record each scheduled request's sampled code (codebook_size = end-of-audio)."""
        results = []
        for item, code in zip(output.scheduled, sampled_codes, strict=True):
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            self.num_generated_tokens_total += 1
            if code == self.end_of_audio:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                results.append(RequestOutput(request.request_id, None, request.status))
                continue
            request.output_codes.append(code)
            if len(request.output_codes) >= request.max_new_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
            results.append(RequestOutput(request.request_id, code, request.status))
        return results

    # --- internals ---------------------------------------------------------------------
    def _grow_to(self, request: TalkerRequest, num_tokens: int, preempted: list[str]) -> bool:
        """Give `request` pages for `num_tokens`, preempting newest-first. False if it lost."""
        need = self.kv_spec.pages_for(num_tokens) - len(request.pages)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        if need > 0:
            pages = self.allocator.allocate(need)
            assert pages is not None
            request.pages.extend(pages)
        return True

    def _preempt(self, request: TalkerRequest) -> None:
        self.running.remove(request)
        self._free_pages(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions_total += 1
        # Back to the head of its class's queue, ahead of anything that arrived after it.
        queue = self.queues[request.priority]
        index = 0
        while index < len(queue) and queue[index].arrival < request.arrival:
            index += 1
        queue.insert(index, request)

    def _count_wait(self, request: TalkerRequest) -> None:
        """A request's first admission: its wait since it arrived, in its class's histogram
        (a preempted request's later waits are not queue waits of a new request)."""
        if request.queued_at is None:
            return
        self.queue_waits.observe(request.priority, time.monotonic() - request.queued_at)
        request.queued_at = None

    def _finish(self, request: TalkerRequest, status: RequestStatus) -> None:
        self.running.remove(request)
        self._free_pages(request)
        request.status = status
        del self.requests[request.request_id]

    def _free_pages(self, request: TalkerRequest) -> None:
        self.allocator.free(request.pages)
        request.pages = []
