"""Speak fixed sentences through real agent frameworks' OpenAI TTS, unmodified, pointed at an
omni-dp router, and write down exactly what each framework hands on: its audio frames, and the
sample rate each frame says it is at.

Run with the agents venv's python (scripts/setup-agents), never .venv's: pipecat and LiveKit
Agents pin their own openai, httpx, numpy, ... and must not move .venv's. It imports nothing of
omni-dp or of the tests, only the frameworks and the standard library.

    agents_driver.py --base-url http://127.0.0.1:PORT/v1 --out DIR --sentences FILE.json \
        [--framework pipecat --framework livekit ...]

The API key comes from OPENAI_API_KEY (the frameworks' own fallback too), so it is in no argv.

Each framework is driven the way an agent really drives it, with nothing of it replaced:
  pipecat   a minimal pipeline (OpenAITTSService -> a collector) under pipecat's own runner, fed
            one TTSSpeakFrame a sentence: the service's run_tts asks for response_format pcm and
            stamps each chunk with the pipeline's output rate (PipelineParams'
            audio_out_sample_rate, 24 kHz by default), never with the answer's.
  livekit   the plugin's TTS.synthesize(), its default response_format (mp3: decoded, so the
            rate in the mp3's own header is read, then resampled to the plugin's 24 kHz).
  livekit-pcm  the same with response_format="pcm": the bytes are labelled 24 kHz unread.

For each framework DIR/<framework>/<n>.wav holds sentence n's frames, concatenated and written at
the rate the frames claim (so a framework that mislabels the rate shows it as a wrong duration
and a wrong pitch), and DIR/summary.json says, per framework and sentence, the rates and channel
counts its frames carried, how many frames and samples, and any error. Exit 0 when every
framework ran (its errors are in the summary, for the test to show), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
import wave
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

FRAMEWORKS = ("pipecat", "livekit", "livekit-pcm")
# How long one framework may take over all the sentences: a stuck pipeline ends the driver with
# an error in the summary instead of hanging the test until its own timeout.
FRAMEWORK_TIMEOUT_S = 150.0


@dataclass
class Spoken:
    """What a framework handed on for one sentence."""

    text: str
    wav: str = ""
    rates: list[int] = field(default_factory=list)  # each distinct rate its frames claimed
    channels: list[int] = field(default_factory=list)
    frames: int = 0
    samples: int = 0  # per channel
    seconds: float = 0.0  # samples / the rate the frames claimed
    errors: list[str] = field(default_factory=list)
    _pcm: bytearray = field(default_factory=bytearray, repr=False)

    def add(self, pcm: bytes, rate: int, channels: int) -> None:
        """One frame as the framework handed it on: 16-bit PCM, its claimed rate, channels."""
        if rate not in self.rates:
            self.rates.append(rate)
        if channels not in self.channels:
            self.channels.append(channels)
        self.frames += 1
        self.samples += len(pcm) // (2 * channels)
        self._pcm += pcm

    def write(self, path: Path) -> None:
        """The frames as one WAV at the rate they claimed (the first, if they disagreed: the
        summary lists every rate, and the test fails on more than one)."""
        rate = self.rates[0] if self.rates else 24000
        channels = self.channels[0] if self.channels else 1
        with wave.open(str(path), "wb") as out:
            out.setnchannels(channels)
            out.setsampwidth(2)
            out.setframerate(rate)
            out.writeframes(bytes(self._pcm))
        self.wav = str(path)
        self.seconds = self.samples / rate if self.rates else 0.0

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


# --- pipecat ----------------------------------------------------------------------------------


async def speak_pipecat(base_url: str, api_key: str, texts: list[str]) -> list[Spoken]:
    """One pipeline, one TTSSpeakFrame a sentence, then an EndFrame; pipecat's runner runs it
    to the end. The frames are told apart by the context id the service gave each request
    (its on_tts_request event names the id and the text, in the order it speaks them)."""
    from openai import DefaultAsyncHttpxClient
    from pipecat.frames.frames import EndFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.workers.runner import WorkerRunner

    spoken = [Spoken(text) for text in texts]
    contexts: list[str] = []  # context ids, in the order the service was asked to speak
    audio: dict[str, list[tuple[bytes, int, int]]] = {}
    errors: list[str] = []

    class Collector(FrameProcessor):
        """The end of the pipeline, where a transport's output would be: keeps the audio."""

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                audio.setdefault(frame.context_id or "", []).append(
                    (bytes(frame.audio), frame.sample_rate, frame.num_channels))
            await self.push_frame(frame, direction)

    # Its default model and voice. The HTTP client is ours only so that it is closed before the
    # loop is: the service never closes the one it would make (a traceback at exit otherwise).
    http_client = DefaultAsyncHttpxClient()
    tts = OpenAITTSService(api_key=api_key, base_url=base_url, http_client=http_client)

    @tts.event_handler("on_tts_request")
    async def on_tts_request(service, context_id: str, text: str) -> None:
        contexts.append(context_id)

    worker = PipelineWorker(Pipeline([tts, Collector()]))

    @worker.event_handler("on_pipeline_error")
    async def on_pipeline_error(task, frame) -> None:
        errors.append(str(frame.error))

    await worker.queue_frames([*(TTSSpeakFrame(text) for text in texts), EndFrame()])
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    try:
        await runner.run()
    finally:
        await http_client.aclose()
    if len(contexts) != len(texts):
        errors.append(f"the service was asked {len(contexts)} times for {len(texts)} sentences")
    for context_id, one in zip(contexts, spoken, strict=False):
        for pcm, rate, channels in audio.pop(context_id, []):
            one.add(pcm, rate, channels)
    if audio:
        errors.append(f"audio under context ids no request had: {sorted(audio)}")
    for one in spoken:
        one.errors.extend(errors)
    return spoken


# --- LiveKit Agents -------------------------------------------------------------------------------


async def speak_livekit(base_url: str, api_key: str, texts: list[str],
                        response_format: str | None) -> list[Spoken]:
    """The plugin's TTS.synthesize() for each sentence (what an agent's session calls for a
    non-streaming TTS, one sentence at a time), its frames read as they come."""
    from livekit.plugins import openai as livekit_openai

    options = {} if response_format is None else {"response_format": response_format}
    tts = livekit_openai.TTS(base_url=base_url, api_key=api_key, **options)
    spoken = [Spoken(text) for text in texts]
    try:
        for one in spoken:
            try:
                async with tts.synthesize(one.text) as stream:
                    async for event in stream:
                        frame = event.frame
                        one.add(bytes(frame.data), frame.sample_rate, frame.num_channels)
            except Exception as exc:  # reported in the summary, for the test to show
                one.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        await tts.aclose()
    return spoken


# --- the run ----------------------------------------------------------------------------------


async def speak(name: str, base_url: str, api_key: str, texts: list[str]) -> list[Spoken]:
    if name == "pipecat":
        return await speak_pipecat(base_url, api_key, texts)
    return await speak_livekit(base_url, api_key, texts,
                               "pcm" if name == "livekit-pcm" else None)


def quiet_logs() -> None:
    """Warnings and errors only: pipecat logs every frame's way at DEBUG through loguru, which
    would bury what the test shows of this process's stderr when it fails."""
    import logging

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    logging.basicConfig(level=logging.WARNING)


def versions() -> dict[str, str]:
    return {name: version(name) for name in
            ("pipecat-ai", "livekit-agents", "livekit-plugins-openai", "openai")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the router's URL, ending in /v1")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sentences", required=True, type=Path, help="a JSON list of texts")
    parser.add_argument("--framework", action="append", choices=FRAMEWORKS)
    args = parser.parse_args(argv)
    texts = json.loads(args.sentences.read_text())
    quiet_logs()
    api_key = os.environ.get("OPENAI_API_KEY") or "unused"
    summary: dict = {"versions": versions(), "frameworks": {}}
    for name in args.framework or FRAMEWORKS:
        started = time.monotonic()
        try:
            spoken = asyncio.run(asyncio.wait_for(
                speak(name, args.base_url, api_key, texts), FRAMEWORK_TIMEOUT_S))
        except Exception as exc:  # one framework's failure, for the test to show
            trace = traceback.format_exc(limit=-3)
            spoken = [Spoken(text, errors=[f"{type(exc).__name__}: {exc}\n{trace}"])
                      for text in texts]
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        for index, one in enumerate(spoken):
            one.write(folder / f"{index}.wav")
        summary["frameworks"][name] = {
            "seconds_taken": round(time.monotonic() - started, 2),
            "sentences": [one.summary() for one in spoken]}
        print(f"agents_driver: {name}: {sum(one.seconds for one in spoken):.2f} s of audio "
              f"in {time.monotonic() - started:.1f} s", file=sys.stderr)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
