"""The voice's pipeline, as the HTTP front sees it: the same calls as engine/pipeline.py's,
wherever the placement runs its two stages.

preprocess (text → sentences → phoneme ids; engine/voice/preprocess.py) → voice (one sentence
per call of the ONNX graph) → the request's chunks. A stage in `main` runs on this process's
worker threads (the event loop never waits on espeak-ng or onnxruntime); a stage elsewhere is a
request → reply with its stage process (Prepare → Prepared, Speak → Spoken; with voice replicas,
each sentence to the least-loaded). A request submits its next sentence only when the previous
one is spoken, so concurrent requests take turns sentence by sentence: a short request is not
stuck behind a long one, and each sentence streams as soon as it is spoken.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from omni_dp.engine import messages
from omni_dp.engine.gpu_busy import ON_CPU, NotRecording, busy_answer
from omni_dp.engine.pipeline import STAGE_START_TIMEOUT_S, EngineFailed, RequestCutOff
from omni_dp.engine.placement_plan import main_of
from omni_dp.engine.preprocess import PreprocessError, SpeechAsk
from omni_dp.engine.scheduler import SchedulerStats
from omni_dp.engine.stage_group import process_rows, start_group, wait_until_ready
from omni_dp.engine.stage_set import LeastLoaded
from omni_dp.engine.voice.messages import Speak, Spoken
from omni_dp.engine.voice.model import VoiceModel, VoiceSession, pcm16
from omni_dp.engine.voice.phonemes import PhonemizeError
from omni_dp.engine.voice.preprocess import PHONEMIZER_THREADS, VoicePreprocess, VoiceSpeech
from omni_dp.engine.wire import WireError
from omni_dp.placement.model import MAIN_PROCESS, Placement

log = logging.getLogger(__name__)

NOT_TIMED_ON_GPU = "onnxruntime runs the voice: its kernels are not bracketed by timing events"


class VoicePipeline:
    def __init__(self, voice: VoiceModel, placement: Placement, *, threads: int,
                 max_input_chars: int, on_fatal: Callable[[str], None],
                 launch_base: dict | None = None,
                 log_setup: tuple[str, str] = ("info", "text")) -> None:
        """`launch_base`: the StageLaunch fields of every stage process, when there are any."""
        main = main_of(placement)
        self.voice = voice
        self.placement = placement
        self.device = main.device
        self.preprocess = VoicePreprocess(voice, max_input_chars)
        self.failure: str | None = None
        self._on_fatal = on_fatal
        self._cut_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: VoiceSession | None = None
        self._ids = itertools.count()
        self._answers: dict[str, asyncio.Future] = {}  # Prepared and Spoken, by their ids
        self._in_flight = 0
        self._speaking = 0  # sentences being spoken now, here or elsewhere (counted on the loop)
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
        """The engine's gauges: sentences being spoken now, requests waiting for their turn;
        no KV."""
        return SchedulerStats(num_running=self._speaking,
                              num_waiting=self._in_flight - self._speaking, num_pages_used=0,
                              num_pages_total=0, num_preemptions_total=0,
                              num_generated_tokens_total=0)

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
                                           lambda key: messages.Prepare(key, ask))
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

    async def _speak(self, ids: list[int], speech: VoiceSpeech) -> bytes:
        """One sentence's PCM, spoken here or by the least-loaded voice process."""
        self._speaking += 1
        try:
            if self.speaks_here:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._worker, self._speak_here, ids, speech)
            index = self._voice_policy.bind()
            try:
                spoken = await self._ask(self._voices[index], "s", lambda key: Speak(
                    key, ids, speech.length_scale, speech.prompt.speaker_id))
            finally:
                self._voice_policy.release(index)
            return spoken.pcm
        finally:
            self._speaking -= 1

    def _speak_here(self, ids: list[int], speech: VoiceSpeech) -> bytes:
        assert self._session is not None
        return pcm16(self._session.run(ids, length_scale=speech.length_scale,
                                       speaker=speech.prompt.speaker_id))

    async def synthesize(self, speech: VoiceSpeech) -> AsyncIterator[bytes]:
        """Yield each sentence's PCM as it is spoken; stop submitting if the caller stops."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        self._in_flight += 1
        try:
            for ids in speech.sentences:
                if self._cut_reason is not None:
                    raise RequestCutOff(self._cut_reason)
                started = time.perf_counter()
                try:
                    pcm = await self._speak(ids, speech)
                except EngineFailed:
                    raise
                except Exception as exc:  # onnxruntime's errors, or the pool shut down
                    if self._cut_reason is not None:
                        raise RequestCutOff(self._cut_reason) from None
                    self._fail(f"the voice stage failed: {exc}")
                    raise EngineFailed(str(exc)) from None
                log.debug("voice: %d phoneme ids → %d samples in %.3f s", len(ids),
                          len(pcm) // 2, time.perf_counter() - started)
                yield pcm
        finally:
            self._in_flight -= 1

    def cut_off_all(self, reason: str) -> None:
        """Every in-flight request ends with the cut-off error at its next sentence."""
        self._cut_reason = reason

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
