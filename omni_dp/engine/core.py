"""The stage workers: the talker's step loop and the vocoder's chunk loop, one thread each.

Each worker owns its state and reads one inbox; nothing else touches its objects. Torch releases
the GIL inside kernels, so the vocoder decodes while the talker computes the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import RequestOutput, RequestStatus, Scheduler, TalkerRequest
from omni_dp.engine.vocoder import ChunkSchedule, Vocoder, VocoderStream

log = logging.getLogger(__name__)


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
    ) -> None:
        super().__init__(on_fatal)
        self.scheduler = scheduler
        self.runner = runner
        self.emit = emit

    def serve(self) -> None:
        while self._drain_inbox(block=not self.scheduler.has_requests()):
            self.step()

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

    Inbox: StepOutputs, in the order the talker produced them.
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

    def serve(self) -> None:
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
        for request_id, codes in new_codes.items():
            stream = self.streams.get(request_id)
            if stream is None:
                stream = self.streams[request_id] = VocoderStream(self.vocoder, self.schedule)
            done = request_id in finished
            for chunk in stream.push(codes, done):
                self.deliver(request_id, chunk, False)
            if done:
                del self.streams[request_id]
                self.deliver(request_id, None, True)
