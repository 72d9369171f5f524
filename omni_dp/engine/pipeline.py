"""The built-in pipeline assembled in one process, with an asyncio face for the HTTP server.

preprocess (on the event loop: cheap, and it must reject bad input before a response starts)
→ talker worker → vocoder worker → the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from omni_dp.engine.core import Abort, Add, TalkerWorker, VocoderWorker
from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.preprocess import TalkerPrompt
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import Scheduler, SchedulerStats, TalkerRequest
from omni_dp.engine.stages import DEFAULT_STAGES, process_table, validate_placement
from omni_dp.engine.vocoder import ChunkSchedule
from omni_dp.engine.weights import PipelineModels

log = logging.getLogger(__name__)

_END = object()


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
        models: PipelineModels,
        kv_cache: KVCache,
        device: torch.device,
        *,
        max_running_requests: int,
        on_fatal: Callable[[str], None],
    ) -> None:
        validate_placement(DEFAULT_STAGES)
        self.cfg = models.cfg
        self.device = device
        self.kv_cache = kv_cache
        self.scheduler = Scheduler(
            kv_cache.spec,
            end_of_audio=self.cfg.end_of_audio,
            max_running_requests=max_running_requests,
        )
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self.failure: str | None = None
        self._on_fatal = on_fatal
        runner = ModelRunner(models.talker, self.kv_cache, device)
        self.vocoder_worker = VocoderWorker(
            models.vocoder,
            ChunkSchedule(self.cfg.vocoder.first_chunk_tokens, self.cfg.vocoder.chunk_tokens),
            deliver=self._deliver_threadsafe,
            on_fatal=self._fatal_threadsafe,
        )
        self.talker_worker = TalkerWorker(
            self.scheduler, runner, emit=self.vocoder_worker.inbox.put,
            on_fatal=self._fatal_threadsafe,
        )

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.vocoder_worker.start()
        self.talker_worker.start()

    def stop(self) -> None:
        self.talker_worker.stop()
        self.vocoder_worker.stop()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def processes(self) -> list[dict]:
        return process_table(DEFAULT_STAGES, os.getpid(), str(self.device))

    # --- requests ----------------------------------------------------------------------
    def check_admissible(self, prompt: TalkerPrompt, max_new_tokens: int) -> None:
        """Raise AdmissionError for a request this replica can never serve."""
        self.scheduler.check_admissible(len(prompt.token_ids), max_new_tokens)

    async def synthesize(
        self, prompt: TalkerPrompt, *, max_new_tokens: int, seed: int
    ) -> AsyncIterator[bytes]:
        """Yield the request's PCM chunks as they are decoded; abort it if the caller stops."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        request_id = f"r{next(self._ids)}"
        chunks: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = chunks
        request = TalkerRequest(
            request_id, list(prompt.token_ids), max_new_tokens, seed, self.cfg.first_code_id
        )
        self.talker_worker.inbox.put(Add(request))
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
            if not finished:
                # Client gone, or the consumer stopped early: free its pages now.
                self.talker_worker.inbox.put(Abort(request_id))

    def cut_off_all(self, reason: str) -> None:
        """End every in-flight request with RequestCutOff (drain time is up)."""
        for chunks in self._queues.values():
            chunks.put_nowait(_Failure(reason, RequestCutOff))

    # --- called from worker threads ----------------------------------------------------
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
        self._loop.call_soon_threadsafe(self._fail, reason)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s", reason)
            for chunks in self._queues.values():
                chunks.put_nowait(_Failure(reason.splitlines()[0]))
            self._on_fatal(reason)
