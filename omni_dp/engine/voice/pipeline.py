"""The voice's pipeline, as the HTTP front sees it: the same calls as engine/pipeline.py's,
wherever the placement runs its two stages.

preprocess (text → sentences → phoneme ids; engine/voice/preprocess.py) → voice (one sentence
per call of the ONNX graph) → the request's chunks. A stage in `main` runs on this process's
worker threads (the event loop never waits on espeak-ng or onnxruntime); a stage elsewhere is a
request → reply with its stage process (Prepare → Prepared, Speak → Spoken; with voice replicas,
each sentence to the least-loaded).

Lookahead (--voice-lookahead W, default 2): while a request's sentence i streams, its sentences
i+1 … i+W are being spoken, so one long request keeps two voice workers or processes busy and
the next sentence is ready when the previous one has been sent; the chunks still come out in
order. The window opens when the first sentence is spoken, not before: until the first audio
the request's first sentence has the workers (and the cores) to itself, so lookahead costs the
time to first audio nothing. The window is per request and small, and a request refills it
only as its own sentences finish: it has at most W sentences submitted (one at W = 0), and
holds the PCM of at most those and the one streaming, so concurrent requests still take turns
a few sentences at a time on the workers' FIFO queues (a short request waits behind at most W
sentences of each other request, not behind a long one's whole text), and the sentences in
flight are at most W × requests. W = 0 is one sentence at a time, as before lookahead.
Priority classes (X-Omni-DP-Priority): a submitted sentence first takes a slot of a
PriorityGate (engine/priority_gate.py; one slot per voice worker), so when every worker is
busy an interactive request's next sentence runs before queued default and bulk sentences,
with bulk kept a share (--priority-share-every). A
request that ends early (the client gone: the server closes this generator; a cut-off:
cut_off_all) cancels its window: a sentence still queued on a local worker never starts, one
already running there runs to its end (a thread cannot be interrupted) and its PCM is dropped;
a stage process's answer to a cancelled sentence is dropped on arrival. No task of the
request outlives it.

Reproducibility: a Piper graph draws its noise (noise_scale, noise_w) inside itself from
onnxruntime's RandomNormalLike, whose generator is seeded once per session and shared by every
call; a request's audio depends on what ran before it in that process. A seed cannot reproduce
it, so the replica never marks an answer resumable (docs/voice.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from omni_dp.contract import Priority
from omni_dp.engine import messages
from omni_dp.engine.gpu_busy import ON_CPU, NotRecording, busy_answer
from omni_dp.engine.options import (
    DEFAULT_PRIORITY_SHARE_EVERY,
    DEFAULT_VOICE_FIRST_PIECE_CHARS,
    DEFAULT_VOICE_LOOKAHEAD,
)
from omni_dp.engine.pipeline import STAGE_START_TIMEOUT_S, EngineFailed, RequestCutOff
from omni_dp.engine.placement_plan import main_of
from omni_dp.engine.preprocess import PreprocessError, SpeechAsk
from omni_dp.engine.priority_gate import PriorityGate
from omni_dp.engine.scheduler import SchedulerStats
from omni_dp.engine.stage_group import process_rows, start_group, wait_until_ready
from omni_dp.engine.stage_set import LeastLoaded
from omni_dp.engine.voice.messages import Speak, Spoken
from omni_dp.engine.voice.model import VoiceModel, VoiceSession, pcm16
from omni_dp.engine.voice.phonemes import PhonemizeError
from omni_dp.engine.voice.preprocess import PHONEMIZER_THREADS, VoicePreprocess, VoiceSpeech
from omni_dp.engine.wire import WireError
from omni_dp.placement.model import MAIN_PROCESS, Placement
from omni_dp.tracing import current_traceparent

log = logging.getLogger(__name__)

NOT_TIMED_ON_GPU = "onnxruntime runs the voice: its kernels are not bracketed by timing events"


class VoicePipeline:
    def __init__(self, voice: VoiceModel, placement: Placement, *, threads: int,
                 max_input_chars: int, on_fatal: Callable[[str], None],
                 launch_base: dict | None = None,
                 log_setup: tuple[str, str] = ("info", "text"),
                 lookahead: int = DEFAULT_VOICE_LOOKAHEAD,
                 first_piece_chars: int = DEFAULT_VOICE_FIRST_PIECE_CHARS,
                 priority_share_every: int = DEFAULT_PRIORITY_SHARE_EVERY) -> None:
        """`launch_base`: the StageLaunch fields of every stage process, when there are any.
        `lookahead`: --voice-lookahead; `first_piece_chars`: --voice-first-piece-chars (this
        process's preprocess; a stage process's reads its launch); `priority_share_every`:
        --priority-share-every (engine/priority.py)."""
        if lookahead < 0:
            raise ValueError(f"lookahead must not be negative, got {lookahead}")
        main = main_of(placement)
        self.voice = voice
        self.placement = placement
        self.device = main.device
        self.lookahead = lookahead
        self.preprocess = VoicePreprocess(voice, max_input_chars, first_piece_chars)
        self.failure: str | None = None
        self._on_fatal = on_fatal
        self._cut_reason: str | None = None
        self._cut: asyncio.Future | None = None  # done once cut_off_all ran (on its loop)
        self._idle = 0  # requests streaming a sentence with none after it submitted
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: VoiceSession | None = None
        self._ids = itertools.count()
        self._answers: dict[str, asyncio.Future] = {}  # Prepared and Spoken, by their ids
        self._in_flight = 0
        self._speaking = 0  # sentences submitted and not done, here or elsewhere (on the loop)
        self.group, self.threads = start_group(
            placement, launch_base, threads, on_message=self._from_stages,
            on_fatal=self._fatal_threadsafe, log_setup=log_setup)
        self.speaks_here = "voice" in main.stages
        self.prepares_here = "preprocess" in main.stages
        # The local stages' workers: one per thread of main's share for the voice (its
        # sentences of different requests take turns), two for espeak-ng's processes.
        self._worker = ThreadPoolExecutor(self.threads[MAIN_PROCESS], thread_name_prefix="voice")
        self._phonemizers = ThreadPoolExecutor(PHONEMIZER_THREADS, thread_name_prefix="phonemes")
        self._voices = [] if self.speaks_here else self.group.endpoint_of("voice")
        self._preprocessors = [] if self.prepares_here else self.group.endpoint_of("preprocess")
        self._voice_policy = LeastLoaded(max(1, len(self._voices)))
        # One slot per voice worker: here main's pool, elsewhere each voice process's pool
        # (engine/voice/stages.py: one worker per thread of its share).
        slots = (self.threads[MAIN_PROCESS] if self.speaks_here else
                 sum(max(1, self.threads.get(p.name, 1)) for p in placement.processes
                     if "voice" in p.stages))
        self._gate = PriorityGate(max(1, slots), priority_share_every)
        self._preprocess_policy = LeastLoaded(max(1, len(self._preprocessors)))
        self.recorder = NotRecording(NOT_TIMED_ON_GPU if self.device.startswith("cuda")
                                     else ON_CPU)

    # --- lifecycle ---------------------------------------------------------------------
    def load(self) -> None:
        """Make this process's ONNX session, if it speaks here (from a worker thread: it takes
        a fraction of a second)."""
        if self.speaks_here:
            self._session = VoiceSession(self.voice, self.device)

    def start(self) -> None:
        """Start the stage processes (from the main thread: they die with it)."""
        self._loop = asyncio.get_running_loop()
        if self.group is not None:
            self.group.spawn()

    async def wait_ready(self, stopped: asyncio.Event) -> bool:
        return await wait_until_ready(self.group, stopped, STAGE_START_TIMEOUT_S)

    def stop(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._phonemizers.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.stop()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> SchedulerStats:
        """The engine's gauges: sentences submitted now (being spoken, or queued for a worker
        within their requests' windows), requests with none submitted (between two of their
        sentences: lookahead 0 always is, a window only at its end); no KV."""
        wait_counts, wait_sums = self._gate.waits.snapshot()
        return SchedulerStats(num_running=self._speaking, num_waiting=self._idle,
                              num_pages_used=0,
                              num_pages_total=0, num_preemptions_total=0,
                              num_generated_tokens_total=0,
                              queue_depth=self._gate.depth(), queue_wait_counts=wait_counts,
                              queue_wait_sum=wait_sums)

    def gpu_busy(self, since: float) -> dict:
        elsewhere = [p.name for p in self.placement.processes
                     if p.name != MAIN_PROCESS and "voice" in p.stages]
        recorders = {"voice": self.recorder} if self.speaks_here else {}
        return busy_answer(self.device, recorders, since, elsewhere)

    def processes(self) -> list[dict]:
        return process_rows(self.placement, self.threads, self.group)

    # --- requests ----------------------------------------------------------------------
    async def prepare(self, ask: SpeechAsk) -> VoiceSpeech:
        """The preprocess stage's answer; PreprocessError (a 400) for what can never be
        spoken, EngineFailed (a 503) when the phonemizer failed."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if not self.prepares_here:
            return await self._prepare_elsewhere(ask)
        checked = self.preprocess.check(ask)
        loop = asyncio.get_running_loop()
        try:
            ids = await asyncio.gather(*(
                loop.run_in_executor(self._phonemizers, self.preprocess.ids_of, sentence)
                for sentence in checked.sentences))
        except PhonemizeError as exc:  # this request's (a 503: another replica may try); the
            # program's presence was checked by the plan, so the replica itself stays up
            log.error("the phonemizer failed: %s", exc)
            raise EngineFailed(f"the phonemizer failed: {exc}") from None
        return self.preprocess.speech(checked, list(ids))

    async def _prepare_elsewhere(self, ask: SpeechAsk) -> VoiceSpeech:
        assert self.group is not None
        index = self._preprocess_policy.bind()
        try:
            try:
                prepared = await self._ask(self._preprocessors[index], "p",
                                           lambda key: messages.Prepare(
                    key, ask, current_traceparent()))
            except WireError as exc:  # a value no process boundary carries
                raise PreprocessError("input", f"the request cannot be sent to the "
                                               f"preprocess stage: {exc}") from None
        finally:
            self._preprocess_policy.release(index)
        if prepared.speech is not None:
            return prepared.speech
        if prepared.field is None:
            raise EngineFailed(prepared.error or "the preprocess stage could not prepare it")
        raise PreprocessError(prepared.field, prepared.error or "refused")

    async def _ask(self, endpoint: str, prefix: str, make: Callable[[str], object]) -> object:
        """Send a stage process the message `make(key)` and wait for its answer of that key."""
        assert self.group is not None
        key = f"{prefix}{next(self._ids)}"
        answer = asyncio.get_running_loop().create_future()
        self._answers[key] = answer
        try:
            self.group.send(endpoint, make(key))
            return await answer
        finally:
            self._answers.pop(key, None)

    async def _speak(self, ids: list[int], speech: VoiceSpeech, priority: Priority) -> bytes:
        """One sentence's PCM, spoken here or by the least-loaded voice process, once the
        gate gives it a worker's slot (by its request's class)."""
        self._speaking += 1
        held = False  # a slot of the gate this call must give back
        try:
            await self._gate.acquire(priority)
            held = True
            if self.speaks_here:
                job = self._worker.submit(self._speak_here, ids, speech)
                # The slot is free when the worker is, not when this call ends: a sentence
                # cancelled while it runs keeps its worker to the end of the call.
                job.add_done_callback(partial(_release_on, asyncio.get_running_loop(),
                                              self._gate))
                held = False
                return await asyncio.wrap_future(job)
            index = self._voice_policy.bind()
            try:
                spoken = await self._ask(self._voices[index], "s", lambda key: Speak(
                    key, ids, speech.length_scale, speech.prompt.speaker_id,
                    current_traceparent()))
            finally:
                self._voice_policy.release(index)
            return spoken.pcm
        finally:
            if held:
                self._gate.release()
            self._speaking -= 1

    def _speak_here(self, ids: list[int], speech: VoiceSpeech) -> bytes:
        assert self._session is not None
        return pcm16(self._session.run(ids, length_scale=speech.length_scale,
                                       speaker=speech.prompt.speaker_id))

    async def _spoken(self, ids: list[int], speech: VoiceSpeech, priority: Priority) -> bytes:
        """One sentence of a window (a task of its own): its PCM, or the error its request
        ends with. A failure of the voice itself (not a cancellation) fails the replica at
        once, even for a sentence still ahead of the one streaming."""
        started = time.perf_counter()
        try:
            pcm = await self._speak(ids, speech, priority)
        except EngineFailed:
            raise
        except Exception as exc:  # onnxruntime's errors, or the pool shut down
            if self._cut_reason is not None:
                raise RequestCutOff(self._cut_reason) from None
            self._fail(f"the voice stage failed: {exc}")
            raise EngineFailed(str(exc)) from None
        log.debug("voice: %d phoneme ids → %d samples in %.3f s", len(ids), len(pcm) // 2,
                  time.perf_counter() - started)
        return pcm

    def _cut_signal(self) -> asyncio.Future:
        """A future of this loop that is done once cut_off_all has run: each request waits on
        it beside its next sentence, so a cut-off ends every request at once."""
        loop = asyncio.get_running_loop()
        if self._cut is None or self._cut.get_loop() is not loop:
            self._cut = loop.create_future()
            if self._cut_reason is not None:
                self._cut.set_result(None)
        return self._cut

    async def synthesize(self, speech: VoiceSpeech,
                         priority: Priority = Priority.DEFAULT) -> AsyncIterator[bytes]:
        """Yield each sentence's PCM in order, with up to `lookahead` more being spoken while
        one streams; stop submitting, and cancel what was submitted, if the caller stops.
        `priority`: the request's class, the order its sentences get a worker in."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        cut = self._cut_signal()
        window: deque[asyncio.Task[bytes]] = deque()
        upcoming = iter(speech.sentences)

        def submit(up_to: int) -> None:
            for ids in itertools.islice(upcoming, max(0, up_to - len(window))):
                window.append(asyncio.create_task(self._spoken(ids, speech, priority)))

        self._in_flight += 1
        try:
            while True:
                if self._cut_reason is not None:
                    raise RequestCutOff(self._cut_reason)
                submit(1)  # when none is in flight: the first sentence (every one at lookahead 0)
                if not window:
                    return
                head = window[0]
                await asyncio.wait((head, cut), return_when=asyncio.FIRST_COMPLETED)
                if not head.done():  # cut off while it was being spoken
                    raise RequestCutOff(self._cut_reason or "cut off")
                window.popleft()
                if head.cancelled():  # its worker pool shut down under it
                    if self._cut_reason is not None:
                        raise RequestCutOff(self._cut_reason)
                    raise EngineFailed(self.failure or "the voice stage stopped")
                pcm = head.result()  # EngineFailed or RequestCutOff as _spoken raised them
                submit(self.lookahead)  # spoken while this one streams
                idle = 0 if window else 1
                self._idle += idle
                try:
                    yield pcm
                finally:
                    self._idle -= idle
        finally:
            self._in_flight -= 1
            for task in window:
                task.cancel()  # a queued local sentence never starts; an answer is dropped
                task.add_done_callback(_consume)

    def cut_off_all(self, reason: str) -> None:
        """Every in-flight request ends with the cut-off error now, its window cancelled (on
        the event loop's thread, as the server calls it)."""
        self._cut_reason = reason
        if self._cut is not None and not self._cut.done():
            self._cut.set_result(None)

    # --- called from the stage inbox's thread ------------------------------------------
    def _from_stages(self, message: object) -> None:
        if isinstance(message, (messages.Prepared, Spoken)):
            key = (message.request_id if isinstance(message, messages.Prepared)
                   else message.sentence_id)
            self._call_soon(self._answered, key, message)
        else:
            self._fatal_threadsafe(f"the front received a {type(message).__name__} it has no "
                                   "stage for; the placement is miswired")

    def _answered(self, key: str, message: object) -> None:
        answer = self._answers.get(key)
        if answer is not None and not answer.done():
            answer.set_result(message)

    def _call_soon(self, callback: Callable, *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            self._loop.call_soon_threadsafe(callback, *args)

    def _fatal_threadsafe(self, reason: str) -> None:
        self._call_soon(self._fail, reason)

    def _fail(self, reason: str) -> None:
        """The replica cannot serve any more: every waiting request is told, then the server."""
        if self.failure is None:
            self.failure = reason
            log.error("%s", reason)
            for answer in self._answers.values():
                if not answer.done():
                    answer.set_exception(EngineFailed(reason.splitlines()[0]))
            with contextlib.suppress(Exception):
                self._on_fatal(reason)


def _release_on(loop: asyncio.AbstractEventLoop, gate: PriorityGate, _job: object) -> None:
    """A local sentence's worker is done (in its thread): its slot goes back, on the loop."""
    with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
        loop.call_soon_threadsafe(gate.release)


def _consume(task: asyncio.Task) -> None:
    """A cancelled window's sentence: its outcome is nobody's (no "never retrieved" log)."""
    if not task.cancelled():
        task.exception()
