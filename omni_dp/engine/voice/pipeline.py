"""The voice's pipeline, as the HTTP front sees it: the same calls as engine/pipeline.py's.

preprocess (text → sentences → phoneme ids; espeak-ng in a worker thread, so the event loop
never waits on a process) → voice (one sentence per call of the ONNX graph, on one of the
replica's `threads` worker threads) → the request's chunks. A request submits its next sentence
only when the previous one is spoken, so concurrent requests take turns sentence by sentence on
the workers: a short request is not stuck behind a long one, and each sentence streams as soon
as it is spoken.

Reproducibility: a Piper graph draws its noise (noise_scale, noise_w) inside itself from
onnxruntime's RandomNormalLike, whose generator is seeded once per session and shared by every
call; a request's audio depends on what ran before it in that process. A seed cannot reproduce
it, so the replica never marks an answer resumable (docs/voice.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from omni_dp.engine.gpu_busy import ON_CPU, NotRecording, busy_answer
from omni_dp.engine.pipeline import EngineFailed, RequestCutOff
from omni_dp.engine.preprocess import VOICES, PreprocessError, SpeechAsk, normalize_text
from omni_dp.engine.scheduler import SchedulerStats
from omni_dp.engine.voice.model import VoiceModel, VoiceSession, pcm16
from omni_dp.engine.voice.phonemes import (
    PhonemizeError,
    phoneme_ids,
    phonemize,
    split_sentences,
)

log = logging.getLogger(__name__)

VOICE_STAGES = ("preprocess", "voice")
NOT_TIMED_ON_GPU = "onnxruntime runs the voice: its kernels are not bracketed by timing events"


@dataclass(frozen=True)
class VoicePrompt:
    text: str  # normalised
    speaker_id: int
    token_ids: list[int]  # every sentence's phoneme ids, for the usage figures


@dataclass(frozen=True)
class VoiceSpeech:
    """A request the voice stage can speak: its sentences' ids, speaker and speaking rate."""

    prompt: VoicePrompt
    sentences: list[list[int]]
    length_scale: float
    seed: int | None  # accepted, and reproduces nothing (the module's docstring says why)


class VoicePipeline:
    def __init__(self, voice: VoiceModel, device: str, *, threads: int, max_input_chars: int,
                 on_fatal: Callable[[str], None]) -> None:
        self.voice = voice
        self.device = device
        self.threads = {"main": threads}
        self.max_input_chars = max_input_chars
        self.failure: str | None = None
        self._on_fatal = on_fatal
        self._cut_reason: str | None = None
        self._session: VoiceSession | None = None
        # The voice stage: a worker per thread; sentences of different requests take turns.
        self._worker = ThreadPoolExecutor(threads, thread_name_prefix="voice")
        self._phonemizers = ThreadPoolExecutor(2, thread_name_prefix="phonemes")
        self._in_flight = 0
        self._speaking = 0  # sentences on the workers now (a gauge, under its lock)
        self._speaking_lock = threading.Lock()
        self.recorder = NotRecording(NOT_TIMED_ON_GPU if device.startswith("cuda") else ON_CPU)

    # --- lifecycle ---------------------------------------------------------------------
    def load(self) -> None:
        """Make the ONNX session (from a worker thread: it takes a fraction of a second)."""
        self._session = VoiceSession(self.voice, self.device)

    def start(self) -> None: ...

    async def wait_ready(self, stopped: asyncio.Event) -> bool:
        return True

    def stop(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._phonemizers.shutdown(wait=False, cancel_futures=True)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> SchedulerStats:
        """The engine's gauges: requests speaking now and waiting for their turn; no KV."""
        return SchedulerStats(num_running=self._speaking,
                              num_waiting=self._in_flight - self._speaking, num_pages_used=0,
                              num_pages_total=0, num_preemptions_total=0,
                              num_generated_tokens_total=0)

    def gpu_busy(self, since: float) -> dict:
        return busy_answer(self.device, {"voice": self.recorder}, since)

    def processes(self) -> list[dict]:
        return [{"pid": os.getpid(), "role": "main", "device": self.device,
                 "stages": list(VOICE_STAGES), "threads": self.threads["main"]}]

    # --- requests ----------------------------------------------------------------------
    def speaker_of(self, voice_name: str) -> int:
        """OpenAI's voice names (so existing clients work) and the voice's own speakers."""
        if voice_name in self.voice.speaker_id_map:
            return self.voice.speaker_id_map[voice_name]
        if voice_name in VOICES:
            return VOICES.index(voice_name) % self.voice.num_speakers
        choices = ", ".join([*VOICES, *self.voice.speaker_id_map])
        raise PreprocessError("voice", f"unknown voice {voice_name!r}; choose one of {choices}")

    async def prepare(self, ask: SpeechAsk) -> VoiceSpeech:
        """The preprocess stage; PreprocessError (a 400) for what can never be spoken."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if ask.max_new_tokens is not None:
            raise PreprocessError("max_new_tokens", "max_new_tokens counts the codec tokens of "
                                  "the seeded presets; a Piper voice has none (omit it)")
        speaker = self.speaker_of(ask.voice)
        text = normalize_text(ask.input)
        if not text:
            raise PreprocessError("input", "input is empty after normalisation; send some text")
        if len(text) > self.max_input_chars:
            raise PreprocessError(
                "input", f"input has {len(text)} characters; the limit is {self.max_input_chars}")
        loop = asyncio.get_running_loop()
        try:
            sentences = await asyncio.gather(*(
                loop.run_in_executor(self._phonemizers, self._ids_of, sentence)
                for sentence in split_sentences(text)))
        except PhonemizeError as exc:  # this request's (a 503: another replica may try); the
            # program's presence was checked by the plan, so the replica itself stays up
            log.error("the phonemizer failed: %s", exc)
            raise EngineFailed(f"the phonemizer failed: {exc}") from None
        sentences = [ids for ids in sentences if len(ids) > 3]  # more than BOS, pad, EOS
        if not sentences:
            raise PreprocessError("input", "input has nothing to speak (no phonemes)")
        length_scale = self.voice.length_scale / (ask.speed or 1.0)
        every = [i for ids in sentences for i in ids]
        return VoiceSpeech(VoicePrompt(text, speaker, every), sentences, length_scale, ask.seed)

    def _ids_of(self, sentence: str) -> list[int]:
        return phoneme_ids(phonemize(sentence, self.voice.espeak_voice),
                           self.voice.phoneme_id_map)

    def _speak(self, ids: list[int], speech: VoiceSpeech) -> bytes:
        assert self._session is not None
        with self._speaking_lock:
            self._speaking += 1
        try:
            samples = self._session.run(ids, length_scale=speech.length_scale,
                                        speaker=speech.prompt.speaker_id)
        finally:
            with self._speaking_lock:
                self._speaking -= 1
        return pcm16(samples)

    async def synthesize(self, speech: VoiceSpeech) -> AsyncIterator[bytes]:
        """Yield each sentence's PCM as it is spoken; stop submitting if the caller stops."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        loop = asyncio.get_running_loop()
        self._in_flight += 1
        try:
            for ids in speech.sentences:
                if self._cut_reason is not None:
                    raise RequestCutOff(self._cut_reason)
                started = time.perf_counter()
                try:
                    pcm = await loop.run_in_executor(self._worker, self._speak, ids, speech)
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

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s", reason)
            with contextlib.suppress(Exception):
                self._on_fatal(reason)
