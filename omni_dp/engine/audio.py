"""Audio containers on the wire: WAV headers and SSE events around 16-bit mono PCM."""

from __future__ import annotations

import base64
import json
import struct

_UNKNOWN_SIZE = 0xFFFFFFFF  # streamed WAV: the length is not known when the header is sent


def wav_header(sample_rate: int, num_data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for mono 16-bit PCM.

    With `num_data_bytes=None` (streaming) both size fields are 0xFFFFFFFF, the convention
    ffmpeg, browsers and OpenAI's own streamed WAV use for "read until the end".
    """
    if num_data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        riff_size, data_size = 36 + num_data_bytes, num_data_bytes
    byte_rate = sample_rate * 2
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, 2, 16)
        + b"data" + struct.pack("<I", data_size)
    )


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_audio_delta(chunk: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})


def sse_audio_done(usage: dict) -> bytes:
    return sse_event({"type": "speech.audio.done", "usage": usage})


def sse_error(message: str) -> bytes:
    return sse_event({"type": "error", "error": {"message": message}})
