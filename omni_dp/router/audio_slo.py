"""The audio SLOs of a speech answer as the router relays it: which seconds of audio each chunk
written to the client holds. No I/O here; proxy.py calls `wrote` after each write.

Only POST /v1/audio/speech answers that begin (200) are metered. The format is the answer's
Content-Type (audio/pcm → pcm, …, text/event-stream → sse); for SSE, the audio inside is the
request body's response_format (the replica's default, wav, if absent). The rate is the
answer's X-Sample-Rate (16-bit mono, as every replica answer is: docs/contracts.md).

Where bytes map to time the router times the audio: pcm; wav after its 44-byte header (a
streamed wav's header is its own first write at the replica, but counting bytes makes that
moot); sse whose audio is pcm or wav, from the base64 length of each `speech.audio.delta`
event's audio, not decoded. mp3, opus, aac and flac (raw or in SSE) say when audio began and
ended (TTFA, e2e) and nothing more.

A resumed answer is one answer to the meter: the bytes another replica sends on are counted
on, so the gap while it caught up is an underrun, as the client heard it.
"""

from __future__ import annotations

import json
import time

from omni_dp.audio_slo_metrics import AudioSloMetrics, MeteredAnswer

SPEECH_PATH = "/v1/audio/speech"
SAMPLE_RATE_HEADER = "X-Sample-Rate"
DEFAULT_RESPONSE_FORMAT = "wav"  # the replica's (engine/api.py), when the body names none
WAV_HEADER_BYTES = 44
_FORMATS = {  # Content-Type → response_format (engine/audio.py's CONTENT_TYPES, reversed)
    "audio/pcm": "pcm", "audio/wav": "wav", "audio/mpeg": "mp3", "audio/ogg": "opus",
    "audio/aac": "aac", "audio/flac": "flac",
}
_HEADER_BYTES = {"pcm": 0, "wav": WAV_HEADER_BYTES}  # the timed formats: bytes before audio
# The built-in replica's delta events, as engine/audio.py writes them (compact JSON; resume.py
# reads the same): the audio is the base64 between this and the next quote.
_DELTA_HEAD = b'"type":"speech.audio.delta","audio":"'


def delta_audio_bytes(events: bytes) -> int:
    """Decoded audio bytes in the delta events of `events` (whole events, as the router relays
    SSE), from the base64 lengths alone: no decoding, two C-level finds per event."""
    total, at = 0, events.find(_DELTA_HEAD)
    while at >= 0:
        start = at + len(_DELTA_HEAD)
        end = events.find(b'"', start)
        if end < 0:
            break
        padding = (events[end - 1:end] == b"=") + (events[end - 2:end - 1] == b"=")
        total += (end - start) // 4 * 3 - padding
        at = events.find(_DELTA_HEAD, end)
    return total


def _response_format(body: bytes) -> str:
    """The body's response_format (read only for SSE answers; the replica checked it)."""
    try:
        value = json.loads(body).get("response_format", DEFAULT_RESPONSE_FORMAT)
    except (ValueError, AttributeError):
        return DEFAULT_RESPONSE_FORMAT
    return value if value in _HEADER_BYTES or value in _FORMATS.values() else \
        DEFAULT_RESPONSE_FORMAT


def _rate(headers) -> int | None:
    raw = headers.get(SAMPLE_RATE_HEADER, "")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) > 0 else None


class RelayedAudio:
    """One speech answer's audio as the router writes it to the client."""

    __slots__ = ("answer", "bytes_per_second", "header_left", "sse")

    def __init__(self, answer: MeteredAnswer, sse: bool, header_bytes: int,
                 bytes_per_second: int) -> None:
        self.answer = answer
        self.sse = sse
        self.header_left = header_bytes  # bytes before the audio not yet seen
        self.bytes_per_second = bytes_per_second  # 0: untimed

    @classmethod
    def of(cls, metrics: AudioSloMetrics, method: str, path: str, body: bytes, status: int,
           headers, priority: str, started: float) -> RelayedAudio | None:
        """The meter of an answer to POST /v1/audio/speech that begins (200), or None."""
        if status != 200 or path != SPEECH_PATH or method != "POST":
            return None
        content_type = headers.get("Content-Type", "").partition(";")[0].strip()
        sse = content_type == "text/event-stream"
        fmt = _response_format(body) if sse else _FORMATS.get(content_type)
        if fmt is None:
            return None
        rate = _rate(headers)
        timed = fmt in _HEADER_BYTES and rate is not None
        answer = MeteredAnswer(metrics, "sse" if sse else fmt, priority, started, timed)
        return cls(answer, sse, _HEADER_BYTES.get(fmt, 0), 2 * rate if timed else 0)

    def wrote(self, data: bytes, replica: str) -> None:
        """`data` reached the client (written by `replica`'s answer), just now."""
        size = delta_audio_bytes(data) if self.sse else len(data)
        if self.header_left:
            skipped = min(self.header_left, size)
            self.header_left -= skipped
            size -= skipped
        if size <= 0:
            return
        seconds = size / self.bytes_per_second if self.bytes_per_second else 1.0
        self.answer.add(time.perf_counter(), seconds, replica)

    def finish(self, completed: bool, replica: str | None) -> None:
        """The answer ended (only the first call counts); `replica` labels one without audio."""
        self.answer.finish(completed, replica or "")
