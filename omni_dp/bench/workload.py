"""What the bench sends and how it reads the answer: the request of index i of a workload, the
same for every configuration (seeded), and what each answer holds (audio seconds, tokens).

Three kinds, for the engines omni-dp launches:
- "speech-stream": POST /v1/audio/speech, streamed raw PCM (the built-in engine sends 16-bit
  little-endian mono at the rate of its X-Sample-Rate header, 24 kHz by default), so the
  audio seconds are bytes / (rate × 2) and the first chunk is the time to first audio;
- "speech": the same, `stream: false`, one WAV whose header gives rate and length;
- "completions": POST /v1/completions (vLLM, sglang), streamed SSE with
  `stream_options.include_usage`, so the first text is the time to first token and the last
  event's `usage.completion_tokens` the tokens (vLLM and sglang both send it; where an
  endpoint does not, each event with text counts one token).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

KINDS = ("speech", "speech-stream", "completions")
SPEECH_PATH = "/v1/audio/speech"
COMPLETIONS_PATH = "/v1/completions"
DEFAULT_SAMPLE_RATE = 24000  # the built-in engine's (EngineConfig.sample_rate)
SAMPLE_RATE_HEADER = "X-Sample-Rate"
MAX_TEXT_FILE_BYTES = 4 * 1024**2
MAX_TEXT_CHARS = 4000
MAX_TEXTS = 100_000

# Short and long, plain and punctuated, numbers and names: like a TTS service's traffic.
BUILTIN_TEXTS: tuple[str, ...] = (
    "Hello there.",
    "Your order has shipped and should arrive on Thursday.",
    "The meeting starts in five minutes; please join from the link in the invitation.",
    "Turn left at the next intersection, then continue for two hundred metres.",
    "It will rain this afternoon, with clearing skies by the evening.",
    "Thank you for calling. All of our agents are currently helping other customers.",
    "Battery low.",
    "The quarterly report shows revenue up 12 percent compared with last year.",
    "Please hold while I connect you to the billing department.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman "
    "who told stories to anyone who would listen.",
    "Your verification code is 4 8 1 5 2 3.",
    "Did you remember to lock the back door before leaving?",
    "The next train to Central Station departs from platform three at 10:45.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Wow! That was the best concert I have ever been to.",
    "In case of emergency, remain calm, leave the building by the nearest exit, and "
    "gather at the assembly point in the car park.",
)


class AnswerError(Exception):
    """A 2xx answer that is not a success: an error event in the stream, or no audio."""


@dataclass(frozen=True)
class Workload:
    """The requests of a run: `kind` (KINDS), the texts drawn from, the seed that fixes which
    text (and engine seed) request i gets; for completions the model and max_tokens."""

    kind: str = "speech-stream"
    texts: tuple[str, ...] = BUILTIN_TEXTS
    seed: int = 0
    model: str | None = None  # completions: the served model's name (None: the server's)
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.texts:
            raise ValueError("a workload needs at least one text")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    @property
    def path(self) -> str:
        return COMPLETIONS_PATH if self.kind == "completions" else SPEECH_PATH

    def describe(self) -> str:
        """One line for the report: what was sent."""
        what = {"speech": "speech (one WAV per request)",
                "speech-stream": "speech (streamed PCM)",
                "completions": f"completions (streamed, max_tokens {self.max_tokens})"}
        return f"{what[self.kind]}, {len(self.texts)} texts, seed {self.seed}"

    def request(self, i: int) -> tuple[str, dict]:
        """The path and JSON body of request i: the same for the same (seed, i)."""
        draw = _draw(self.seed, i)
        text = self.texts[draw % len(self.texts)]
        engine_seed = draw >> 16  # 48 bits: under the engine's bound on `seed`
        if self.kind == "completions":
            body: dict = {"prompt": text, "max_tokens": self.max_tokens, "temperature": 0.0,
                          "seed": engine_seed % 2**31, "stream": True,
                          "stream_options": {"include_usage": True}}
            if self.model is not None:
                body["model"] = self.model
            return self.path, body
        streamed = self.kind == "speech-stream"
        return self.path, {"input": text, "response_format": "pcm" if streamed else "wav",
                           "stream": streamed, "seed": engine_seed}

    def reader(self, headers: Mapping[str, str]) -> AnswerReader:
        """A reader for one 2xx answer of this workload (its headers say the sample rate)."""
        if self.kind == "completions":
            return CompletionReader()
        rate = _sample_rate(headers)
        return PcmReader(rate) if self.kind == "speech-stream" else WavReader(rate)


def _draw(seed: int, i: int) -> int:
    """A 64-bit number fixed by (seed, i), independent of Python's hash seed."""
    digest = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _sample_rate(headers: Mapping[str, str]) -> int:
    try:
        rate = int(headers.get(SAMPLE_RATE_HEADER, DEFAULT_SAMPLE_RATE))
    except ValueError:
        return DEFAULT_SAMPLE_RATE
    return rate if rate > 0 else DEFAULT_SAMPLE_RATE


class AnswerReader:
    """Reads one answer chunk by chunk: `feed` says whether the chunk held the first payload
    (audio or a token), `finish` gives (audio seconds, tokens) or raises AnswerError."""

    started = False

    def feed(self, chunk: bytes) -> bool:
        raise NotImplementedError

    def finish(self) -> tuple[float, int]:
        raise NotImplementedError


class PcmReader(AnswerReader):
    """Raw 16-bit mono PCM: every byte is audio."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.bytes = 0

    def feed(self, chunk: bytes) -> bool:
        self.bytes += len(chunk)
        first = bool(chunk) and not self.started
        self.started = self.started or bool(chunk)
        return first

    def finish(self) -> tuple[float, int]:
        # A 200 without audio is the model's answer (an untrained one may stop at once), not
        # the service failing: ok, with no audio (PointResult.empty counts them).
        return self.bytes / (self.rate * 2), 0


class WavReader(PcmReader):
    """One WAV file: its `fmt ` chunk gives the rate, its `data` chunk the audio."""

    def __init__(self, rate: int) -> None:
        super().__init__(rate)
        self.body = bytearray()

    def feed(self, chunk: bytes) -> bool:
        self.body += chunk
        return super().feed(chunk)

    def finish(self) -> tuple[float, int]:
        return wav_seconds(bytes(self.body)), 0  # a WAV of no samples: ok, empty


def wav_seconds(body: bytes) -> float:
    """Seconds of audio in a 16-bit PCM WAV; AnswerError when it is not one. A data size of
    0xFFFFFFFF (a streamed WAV) means "to the end of the file"."""
    if len(body) < 12 or body[:4] != b"RIFF" or body[8:12] != b"WAVE":
        raise AnswerError("the answer is not a WAV file")
    pos, rate, width = 12, None, 2
    while pos + 8 <= len(body):
        name, size = body[pos:pos + 4], struct.unpack("<I", body[pos + 4:pos + 8])[0]
        start = pos + 8
        if name == b"fmt " and size >= 16:
            if len(body) < start + 14:
                raise AnswerError("the WAV answer's fmt chunk is cut short")
            rate, _, block_align = struct.unpack("<IIH", body[start + 4:start + 14])
            width = max(1, block_align)  # bytes per sample frame: 2 for 16-bit mono
            if not rate:
                raise AnswerError("the WAV answer says its sample rate is 0")
        elif name == b"data":
            if rate is None:
                raise AnswerError("the WAV answer has no fmt chunk before its data")
            data = len(body) - start if size == 0xFFFFFFFF else min(size, len(body) - start)
            return data / (rate * width)
        pos = start + size + (size & 1)
    raise AnswerError("the WAV answer has no data chunk")


class CompletionReader(AnswerReader):
    """OpenAI completion SSE: `data: {json}` events ending with `data: [DONE]`. An event with
    an `error` (how vLLM and sglang end a stream that failed) is an AnswerError."""

    def __init__(self) -> None:
        self.pending = b""
        self.text_events = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        self.pending += chunk
        first = False
        *events, self.pending = self.pending.split(b"\n\n")
        for event in events:
            had_text = self._event(event)
            first = first or (had_text and not self.started)
            self.started = self.started or had_text
        return first

    def _event(self, raw: bytes) -> bool:
        data = b"".join(line[5:].strip() for line in raw.splitlines()
                        if line.startswith(b"data:"))
        if not data:
            return False
        if data == b"[DONE]":
            self.done = True
            return False
        try:
            event = json.loads(data)
        except ValueError:
            raise AnswerError(f"an event of the stream is not JSON: {data[:80]!r}") from None
        if not isinstance(event, dict):
            raise AnswerError("an event of the stream is not a JSON object")
        if event.get("error"):
            raise AnswerError(f"the stream ended with an error: {str(event['error'])[:200]}")
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        choices = event.get("choices") or []
        has_text = any(isinstance(c, dict) and c.get("text") for c in choices)
        self.text_events += has_text
        return has_text

    def finish(self) -> tuple[float, int]:
        if self.pending.strip():
            self._event(self.pending)
            self.pending = b""
        if not self.done:
            raise AnswerError("the stream ended before its [DONE]")
        return 0.0, self.usage_tokens if self.usage_tokens is not None else self.text_events


def load_texts(path: Path) -> tuple[str, ...]:
    """One text per line of a UTF-8 file, blank lines skipped; a ValueError naming the file
    (and the line) when it is too big, not text, empty, or a line is too long."""
    try:
        size = path.stat().st_size
        if size > MAX_TEXT_FILE_BYTES:
            raise ValueError(f"{path} is {size} bytes; texts files are limited to "
                             f"{MAX_TEXT_FILE_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read texts from {path}: {exc.strerror or exc}") from None
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{number}: not UTF-8 text") from None
        if not text:
            continue
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"{path}:{number}: {len(text)} characters; a text may have at "
                             f"most {MAX_TEXT_CHARS}")
        if "\x00" in text:
            raise ValueError(f"{path}:{number}: holds a NUL character")
        texts.append(text)
        if len(texts) > MAX_TEXTS:
            raise ValueError(f"{path}: more than {MAX_TEXTS} texts")
    if not texts:
        raise ValueError(f"{path} holds no text (one per line; blank lines are skipped)")
    return tuple(texts)
