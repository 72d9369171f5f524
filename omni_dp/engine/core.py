"""The stage workers: the talker's step loop and the vocoder's chunk loop, one thread each.

Each worker owns its state and reads one inbox; nothing else touches its objects. Torch releases
the GIL inside kernels, so the vocoder decodes while the talker computes the next step; on CUDA
the vocoder has its own stream, so its kernels do not queue behind the talker's either. Nothing
on the device crosses between the two: the talker hands the vocoder Python ints.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_dp.engine.gpu_busy import recorder_for
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import (
    RequestOutput,
    RequestStatus,
    Scheduler,
    SchedulerStats,
    TalkerRequest,
)
from omni_dp.engine.vocoder import ChunkSchedule, Vocoder, VocoderStream, pcm16_bytes

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # a remote talker's gauges reach /metrics at most this often


@dataclass
class Add:
    request: TalkerRequest


@dataclass
class Abort:
    request_id: str


@dataclass
class Stop:
    pass


@dataclass
class StepOutputs:
    """One talker step's outputs, as the vocoder stage receives them."""

    outputs: list[RequestOutput]


class StageWorker:
    """A thread that serves one stage from its inbox until it receives Stop.

    An exception is fatal to the replica: `on_fatal` gets the traceback and the thread ends.
    """

    name = "stage"

    def __init__(self, on_fatal: Callable[[str], None]) -> None:
        self.on_fatal = on_fatal
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(Stop())
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.serve()
        except Exception:
            self.on_fatal(f"{self.name} stage failed:\n{traceback.format_exc()}")

    def serve(self) -> None:
        raise NotImplementedError


class TalkerWorker(StageWorker):
    """schedule → execute → update, for as long as there are requests. Inbox: Add, Abort."""

    name = "talker"

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        emit: Callable[[StepOutputs], None],
        on_fatal: Callable[[str], None],
        on_stats: Callable[[SchedulerStats], None] | None = None,
    ) -> None:
        super().__init__(on_fatal)
        self.scheduler = scheduler
        self.runner = runner
        self.emit = emit
        # A talker in its own process publishes its gauges (the HTTP front cannot read them);
        # in the front's process nothing is sent: /metrics reads the scheduler itself.
        self.on_stats = on_stats
        self._stats_sent = 0.0

    def serve(self) -> None:
        self._publish_stats()  # the empty pool's gauges, before any request
        while self._drain_inbox(block=not self.scheduler.has_requests()):
            self.step()
            self._publish_stats()
        self.runner_stopped()

    def runner_stopped(self) -> None:
        """The loop ended (Stop): a runner with peers (tensor parallel) releases them."""
        stop = getattr(self.runner, "stop", None)
        if stop is not None:
            stop()

    def _publish_stats(self) -> None:
        """Throttled, except when the talker turns idle: the last state is always sent."""
        if self.on_stats is None:
            return
        now = time.monotonic()
        idle = not self.scheduler.has_requests()
        if idle or now - self._stats_sent >= STATS_INTERVAL_S:
            self._stats_sent = now
            self.on_stats(self.scheduler.stats())

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending adds/aborts; wait for one if idle. False once told to stop."""
        while True:
            try:
                message = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(message, Stop):
                return False
            if isinstance(message, Add):
                self.scheduler.add_request(message.request)
            elif self.scheduler.abort_request(message.request_id) is not None:
                # Through the same channel as codes, so the vocoder sees it after them.
                aborted = RequestOutput(message.request_id, None, RequestStatus.FINISHED_ABORTED)
                self.emit(StepOutputs([aborted]))

    def step(self) -> None:
        output = self.scheduler.schedule()
        if output.is_empty:
            return
        codes = self.runner.execute(output)
        results = self.scheduler.update_from_output(output, codes)
        if results:
            self.emit(StepOutputs(results))


class VocoderWorker(StageWorker):
    """Codes in, PCM chunks out through `deliver(request_id, chunk, finished)`.

    Inbox: StepOutputs, in the order the talker produced them. On CUDA every tensor of the
    vocoder's is made and used on `cuda_stream` only, and the thread waits for the device once
    per batch of messages: when it reads that batch's PCM back.
    """

    name = "vocoder"

    def __init__(
        self,
        vocoder: Vocoder,
        schedule: ChunkSchedule,
        deliver: Callable[[str, bytes | None, bool], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        super().__init__(on_fatal)
        self.vocoder = vocoder
        self.schedule = schedule
        self.deliver = deliver
        self.streams: dict[str, VocoderStream] = {}
        self.cuda_stream: torch.cuda.Stream | None = None
        device = vocoder.embed.weight.device
        self.busy = recorder_for(device)  # each batch's GPU busy time (GET /gpu_busy)
        if device.type == "cuda":
            self.cuda_stream = torch.cuda.Stream(device)
            # The weights were moved to the device on the current (default) stream: its
            # work so far comes first. From here on, the vocoder's tensors live on this stream.
            self.cuda_stream.wait_stream(torch.cuda.current_stream(device))

    def serve(self) -> None:
        on_stream = contextlib.nullcontext()
        if self.cuda_stream is not None:
            on_stream = torch.cuda.stream(self.cuda_stream)
        with on_stream:
            while not isinstance(message := self.inbox.get(), Stop):
                self._handle(message)

    def _handle(self, step: StepOutputs) -> None:
        # Merge consecutive steps already queued: fewer, larger decodes when the talker is ahead.
        pending = [step]
        while True:
            try:
                more = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(more, Stop):
                self.inbox.put(more)  # after this batch: nothing can follow a Stop
                break
            pending.append(more)
        new_codes: dict[str, list[int]] = {}
        finished: set[str] = set()
        for batch in pending:
            for out in batch.outputs:
                if out.status == RequestStatus.FINISHED_ABORTED:
                    new_codes.pop(out.request_id, None)
                    self.streams.pop(out.request_id, None)
                    continue
                codes = new_codes.setdefault(out.request_id, [])
                if out.new_code is not None:
                    codes.append(out.new_code)
                if out.status.is_finished:
                    finished.add(out.request_id)
        # (request id, its next chunk, or None once it is finished), in delivery order
        deliveries: list[tuple[str, torch.Tensor | None]] = []
        self.busy.begin()
        for request_id, codes in new_codes.items():
            stream = self.streams.get(request_id)
            if stream is None:
                stream = self.streams[request_id] = VocoderStream(self.vocoder, self.schedule)
            done = request_id in finished
            deliveries += [(request_id, chunk) for chunk in stream.push_pcm(codes, done)]
            if done:
                del self.streams[request_id]
                deliveries.append((request_id, None))
        pcm = iter(self._to_bytes([chunk for _, chunk in deliveries if chunk is not None]))
        for request_id, chunk in deliveries:
            if chunk is None:
                self.deliver(request_id, None, True)
            else:
                self.deliver(request_id, next(pcm), False)

    def _to_bytes(self, chunks: list[torch.Tensor]) -> list[bytes]:
        """int16 chunks on the vocoder's device → PCM bytes, read back in one copy."""
        if not chunks:
            self.busy.cancel()  # nothing was decoded: no device work to time
            return []
        flat = torch.cat(chunks)
        if self.cuda_stream is not None:
            # Into pinned memory, non_blocking, then one wait: this thread, this stream only.
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self.busy.end()  # the batch's last kernel and its copy are queued
            copied = torch.cuda.Event()
            copied.record(self.cuda_stream)
            copied.synchronize()
            flat = host
        else:
            self.busy.end()  # nothing is timed on the CPU unless a test hands in a recorder
        self.busy.synced()
        data = pcm16_bytes(flat)
        pieces, offset = [], 0
        for chunk in chunks:
            size = chunk.numel() * chunk.element_size()
            pieces.append(data[offset : offset + size])
            offset += size
        return pieces
