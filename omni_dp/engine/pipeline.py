"""The built-in pipeline, as the HTTP front sees it: wherever its stages run.

preprocess → talker → vocoder → the request's asyncio queue. The placement
(omni_dp/placement) says which process runs each stage: the stages of `main` run here, as
threads (form ①: all of them); the others in stage processes (engine/stage_group.py) over
pyzmq. Either way the front sends the same messages and receives the same ones, so a request
gives the same bytes in every form.

The preprocess stage answers before the response starts (a request it refuses is a 400, never
a broken stream); it runs on the event loop when it is here (cheap), else as a request-reply to
its process. The talker's Add and Abort go from here on one channel, so they stay in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from omni_dp.contract import Priority
from omni_dp.engine import messages
from omni_dp.engine.core import Abort, Add, StepOutputs
from omni_dp.engine.gpu_busy import busy_answer
from omni_dp.engine.options import DEFAULT_PRIORITY_SHARE_EVERY
from omni_dp.engine.preprocess import (
    PreparedSpeech,
    PreprocessError,
    PreprocessLimits,
    SpeechAsk,
)
from omni_dp.engine.scheduler import SchedulerStats, TalkerRequest
from omni_dp.engine.stage_group import process_rows, start_group, wait_until_ready
from omni_dp.engine.stage_set import LeastLoaded, StageModels, StageSet, VocoderRoute
from omni_dp.engine.wire import WireError
from omni_dp.placement.model import MAIN_PROCESS, Placement
from omni_dp.tracing import current_traceparent

log = logging.getLogger(__name__)

_END = object()
STAGE_START_TIMEOUT_S = 300.0


class EngineFailed(RuntimeError):
    """The pipeline's workers died; the replica must be restarted."""


class RequestCutOff(RuntimeError):
    """The replica is stopping and its drain time ran out before this request finished."""


@dataclass
class _Failure:
    reason: str
    error: type[RuntimeError] = EngineFailed


class Pipeline:
    def __init__(
        self,
        placement: Placement,
        held: StageModels,
        *,
        limits: PreprocessLimits,
        max_running_requests: int,
        on_fatal: Callable[[str], None],
        threads: int = 1,
        launch_base: dict | None = None,
        log_setup: tuple[str, str] = ("info", "text"),
        priority_share_every: int = DEFAULT_PRIORITY_SHARE_EVERY,
    ) -> None:
        """`held`: what main holds for its own stages; `launch_base`: the StageLaunch fields
        of every stage process (engine/stage_process.py), when there are any."""
        self.placement = placement
        self.cfg = held.cfg
        self.device = held.device
        self.limits = limits
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._preparing: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self.failure: str | None = None
        self._on_fatal = on_fatal
        self._remote_stats: SchedulerStats | None = None
        main = next(p for p in placement.processes if p.name == MAIN_PROCESS)
        self.group, self.threads = start_group(
            placement, launch_base, threads, on_message=self._from_stages,
            on_fatal=self._fatal_threadsafe, log_setup=log_setup)
        to_vocoder = None
        if "talker" in main.stages and "vocoder" not in main.stages:
            assert self.group is not None
            group = self.group
            to_vocoder = VocoderRoute([
                (lambda step, endpoint=endpoint: group.send(endpoint, step))
                for endpoint in group.endpoint_of("vocoder")])
        self.local = StageSet(
            main.stages, held, limits=limits, max_running_requests=max_running_requests,
            to_vocoder=to_vocoder, deliver=self._deliver_threadsafe,
            on_fatal=self._fatal_threadsafe, priority_share_every=priority_share_every,
        )
        self._preprocessors = [] if self.local.preprocess else (
            self.group.endpoint_of("preprocess") if self.group else [])
        self._preprocess_policy = LeastLoaded(max(1, len(self._preprocessors)))
        self._talker = None if self.local.talker else self.group.endpoint_of("talker")[0]

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the local stages and the stage processes (from the main thread)."""
        self.local.start()
        if self.group is not None:
            self.group.spawn()

    async def wait_ready(self, stopped: asyncio.Event) -> bool:
        """Until every stage process is ready (True), or `stopped` is set first (False: a
        signal during start-up stops at once rather than after the stages are up)."""
        return await wait_until_ready(self.group, stopped, STAGE_START_TIMEOUT_S)

    def stop(self) -> None:
        # This process's stages first: its talker thread sends on sockets of the group's
        # outbox, which the group's stop closes.
        self.local.stop()
        if self.group is not None:
            self.group.stop()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def stats(self) -> SchedulerStats | None:
        if self.local.scheduler is not None:
            return self.local.scheduler.stats()
        return self._remote_stats

    def gpu_busy(self, since: float) -> dict:
        """The body of GET /gpu_busy: the steps of this process's stages (engine/gpu_busy.py);
        stage processes that run a model stage are named, not timed."""
        elsewhere = [p.name for p in self.placement.processes if p.name != MAIN_PROCESS
                     and {"talker", "vocoder"} & set(p.stages)]
        return busy_answer(str(self.device), self.local.busy_recorders(), since, elsewhere)

    def processes(self) -> list[dict]:
        """The `processes` of /get_server_info: every OS process of this replica."""
        return process_rows(self.placement, self.threads, self.group)

    # --- requests ----------------------------------------------------------------------
    async def prepare(self, ask: SpeechAsk) -> PreparedSpeech:
        """The preprocess stage's answer; PreprocessError when it refuses the request."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if self.local.preprocess is not None:
            return self.local.preprocess.prepare(ask)
        assert self.group is not None
        request_id = f"p{next(self._ids)}"
        answer = self._loop.create_future()
        self._preparing[request_id] = answer
        index = self._preprocess_policy.bind()
        try:
            try:
                prepare = messages.Prepare(request_id, ask, current_traceparent())
                self.group.send(self._preprocessors[index], prepare)
            except WireError as exc:  # a value no process boundary carries
                raise PreprocessError("input", f"the request cannot be sent to the "
                                               f"preprocess stage: {exc}") from None
            prepared: messages.Prepared = await answer
        finally:
            self._preprocess_policy.release(index)
            self._preparing.pop(request_id, None)
        if prepared.speech is None:
            raise PreprocessError(prepared.field or "input", prepared.error or "refused")
        return prepared.speech

    def _to_talker(self, message: Add | Abort) -> None:
        if self._talker is None:
            self.local.handle(message)
        else:
            self.group.send(self._talker, message)

    async def synthesize(self, speech: PreparedSpeech,
                         priority: Priority = Priority.DEFAULT) -> AsyncIterator[bytes]:
        """Yield the request's PCM chunks as they are decoded; abort it if the caller stops.
        `priority`: its class, the order the talker admits it in (engine/priority.py)."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        request_id = f"r{next(self._ids)}"
        chunks: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = chunks
        request = TalkerRequest(request_id, list(speech.prompt.token_ids), speech.max_new_tokens,
                                speech.seed, self.cfg.first_code_id, priority=priority)
        self._to_talker(Add(request))
        finished = False
        try:
            while True:
                item = await chunks.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, _Failure):
                    raise item.error(item.reason)
                yield item
        finally:
            del self._queues[request_id]
            if not finished and self.failure is None:
                # Client gone, or the consumer stopped early: free its pages now.
                self._to_talker(Abort(request_id))

    def cut_off_all(self, reason: str) -> None:
        """End every in-flight request with RequestCutOff (drain time is up)."""
        for chunks in self._queues.values():
            chunks.put_nowait(_Failure(reason, RequestCutOff))

    # --- called from other threads -----------------------------------------------------
    def _from_stages(self, message: object) -> None:
        """The receiver thread: a message from a stage process."""
        if isinstance(message, messages.Audio):
            self._deliver_threadsafe(message.request_id, message.pcm, message.done)
        elif isinstance(message, messages.Prepared):
            self._loop.call_soon_threadsafe(self._prepared, message)
        elif isinstance(message, messages.Stats):
            self._remote_stats = message.stats
        elif isinstance(message, StepOutputs) and self.local.handle(message):
            pass  # a remote talker's step for this process's vocoder
        else:
            self._fatal_threadsafe(f"the front received a {type(message).__name__} it has no "
                                   "stage for; the placement is miswired")

    def _prepared(self, message: messages.Prepared) -> None:
        answer = self._preparing.get(message.request_id)
        if answer is not None and not answer.done():
            answer.set_result(message)

    def _deliver_threadsafe(self, request_id: str, chunk: bytes | None, done: bool) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, chunk, done)

    def _deliver(self, request_id: str, chunk: bytes | None, done: bool) -> None:
        chunks = self._queues.get(request_id)
        if chunks is None:
            return  # its consumer already left
        if chunk:
            chunks.put_nowait(chunk)
        if done:
            chunks.put_nowait(_END)

    def _fatal_threadsafe(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            self._loop.call_soon_threadsafe(self._fail, reason)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s", reason)
            for chunks in self._queues.values():
                chunks.put_nowait(_Failure(reason.splitlines()[0]))
            for answer in self._preparing.values():
                if not answer.done():
                    answer.set_exception(EngineFailed(reason.splitlines()[0]))
            self._on_fatal(reason)
