"""Audio on the wire: WAV headers, compressed containers (libsndfile, FFmpeg), SSE events.

The pipeline produces 16-bit little-endian mono PCM; everything here wraps or encodes it.
FLAC, Ogg Opus and MP3 come from libsndfile through soundfile (its wheels bundle libsndfile
with FLAC, Opus and LAME); AAC from FFmpeg's native encoder through PyAV (its wheels bundle
FFmpeg), in ADTS frames, the raw AAC stream OpenAI's `aac` is. PyAV is the `aac` extra
(scripts/setup installs it): imported when an aac answer is made, so a replica without it
serves every other format and answers aac with a 400 that says what to install.
"""

from __future__ import annotations

import base64
import functools
import importlib
import io
import json
import struct
import threading

import numpy as np
import soundfile

RESPONSE_FORMATS = ("wav", "pcm", "flac", "opus", "mp3", "aac")
CONTENT_TYPES = {
    "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "opus": "audio/ogg",
    "mp3": "audio/mpeg", "aac": "audio/aac",
}
# Which formats go out as they are decoded. wav (sizes 0xFFFFFFFF) and pcm trivially; Ogg Opus
# because an Ogg stream is a sequence of pages libsndfile never revisits; AAC because every ADTS
# frame carries its own header and nothing is written after the last. flac and mp3 are sent
# whole, even when streaming: libsndfile writes their length into the header after the last
# sample (FLAC's STREAMINFO, MP3's LAME/Info frame), and without it libsndfile itself fails at
# the end of a streamed FLAC and decodes a streamed MP3 to the wrong length.
STREAMED_FORMATS = frozenset({"wav", "pcm", "opus", "aac"})
_LIBSNDFILE = {  # response_format -> (libsndfile format, subtype)
    "flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS"), "mp3": ("MP3", "MPEG_LAYER_III"),
}
_ENCODED = frozenset({*_LIBSNDFILE, "aac"})  # a real encoder: CPU time, off the event loop
AAC_BIT_RATE = 64_000  # set, not FFmpeg's default (which depends on the rate and channels)
AAC_EXTRA = "pip install 'omni-dp[aac]'"
_UNKNOWN_SIZE = 0xFFFFFFFF  # streamed WAV: the length is not known when the header is sent
# The only rates Opus encodes; other PCM (a Piper voice's 22,050 Hz) is resampled to the rate
# below for Ogg Opus alone. Every other format keeps the model's own rate.
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
OPUS_FALLBACK_RATE = 24000


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


def _samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2")


@functools.cache
def aac_unavailable() -> str | None:
    """Why this process cannot encode aac (PyAV, the `aac` extra, does not import), or None."""
    try:
        importlib.import_module("av")
    except ImportError as exc:
        return f"PyAV is not installed here ({exc}); {AAC_EXTRA}"
    return None


class AdtsFile:
    """AAC in ADTS frames written into `sink` (an object with `write`), used like a soundfile
    SoundFile: `write(samples)` as they come, `close()` at the end (it flushes the encoder's
    last frames). A decoder gets the samples back after the encoder's priming (1024 samples)
    and padded to whole frames of 1024: ADTS has no field for either."""

    def __init__(self, sink, sample_rate: int) -> None:
        import av  # the `aac` extra: only where an aac answer is made

        self._av = av
        self._rate = sample_rate
        self._container = av.open(sink, "w", format="adts")
        self._stream = self._container.add_stream("aac", rate=sample_rate, layout="mono")
        self._stream.bit_rate = AAC_BIT_RATE
        self.closed = False

    def write(self, samples: np.ndarray) -> None:
        if len(samples):
            frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16",
                                                     layout="mono")
            frame.sample_rate = self._rate
            self._mux(frame)

    def _mux(self, frame) -> None:  # an av.AudioFrame; None: flush
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._mux(None)  # the frames the encoder still holds
        finally:
            self._container.close()

    def __enter__(self) -> AdtsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_encoder(fmt: str, sink, sample_rate: int):
    if fmt == "aac":
        return AdtsFile(sink, sample_rate)
    container, subtype = _LIBSNDFILE[fmt]
    return soundfile.SoundFile(sink, "w", samplerate=sample_rate, channels=1, format=container,
                               subtype=subtype)


class Resampler:
    """Linear interpolation from one rate to another, chunk by chunk with no seam: the
    position and the last input sample carry over, so chunked output is the whole output's
    (within one LSB of rounding) — for Ogg Opus, lossy anyway."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.step = rate_in / rate_out
        self._pos = 0.0  # of the next output sample, in input samples from `_last`
        self._last: np.ndarray = np.zeros(0, dtype=np.float64)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        data = np.concatenate([self._last, samples.astype(np.float64)])
        if len(data) < 2:
            self._last = data
            return np.zeros(0, dtype="<i2")
        count = int(np.floor((len(data) - 1 - self._pos) / self.step)) + 1
        at = self._pos + self.step * np.arange(max(0, count))
        out = np.interp(at, np.arange(len(data)), data)
        self._pos = (self._pos + self.step * max(0, count)) - (len(data) - 1)
        self._last = data[-1:]
        return np.round(out).astype("<i2")


def opus_rate(sample_rate: int) -> int:
    return sample_rate if sample_rate in OPUS_RATES else OPUS_FALLBACK_RATE


def encode_whole(fmt: str, pcm: bytes, sample_rate: int) -> bytes:
    """One complete file of `fmt`; the encoded formats take CPU: call off the event loop."""
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(sample_rate, len(pcm)) + pcm
    if fmt == "opus" and opus_rate(sample_rate) != sample_rate:
        rate = opus_rate(sample_rate)
        pcm = Resampler(sample_rate, rate)(_samples(pcm)).tobytes()
        sample_rate = rate
    out = io.BytesIO()
    with _open_encoder(fmt, out, sample_rate) as sink:
        sink.write(_samples(pcm))
    return out.getvalue()


class _AppendOnly:
    """The file libsndfile writes an Ogg stream into; `take` hands out the bytes written since.

    A write over bytes already taken (sent) would corrupt the stream silently: it raises instead.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._taken = 0

    def write(self, data) -> int:
        if self._pos < self._taken:
            raise OSError("the encoder rewrote audio already sent")
        if self._pos > len(self._buf):
            self._buf += bytes(self._pos - len(self._buf))
        self._buf[self._pos : self._pos + len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        end = len(self._buf) if size is None or size < 0 else self._pos + size
        out = bytes(self._buf[self._pos:end])
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = bytes(self._buf[self._taken:])
        self._taken = len(self._buf)
        return out


class StreamEncoder:
    """Turns a request's PCM chunks into the bytes of `fmt` to send, as they can be sent.

    `header()` first, `feed(chunk)` per chunk, `finish()` at the end (each may return b"");
    `close()` on any path. `blocking` says feed/finish take real CPU (run them in a thread):
    a lock makes a close from the event loop wait for a feed still running in one.
    """

    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.blocking = fmt in _ENCODED
        self._lock = threading.Lock()
        self._pcm = bytearray()  # flac, mp3: the whole request, encoded at the end
        self._sink: _AppendOnly | None = None
        self._file: soundfile.SoundFile | AdtsFile | None = None
        self._resample: Resampler | None = None
        if fmt in ("opus", "aac"):
            self._sink = _AppendOnly()
            rate = opus_rate(sample_rate) if fmt == "opus" else sample_rate
            if rate != sample_rate:
                self._resample = Resampler(sample_rate, rate)
            self._file = _open_encoder(fmt, self._sink, rate)

    def header(self) -> bytes:
        return wav_header(self.sample_rate, None) if self.fmt == "wav" else b""

    def feed(self, pcm: bytes) -> bytes:
        if self.fmt in ("wav", "pcm"):
            return pcm
        with self._lock:
            if self._file is None:
                self._pcm += pcm
                return b""
            samples = _samples(pcm)
            self._file.write(self._resample(samples) if self._resample else samples)
            assert self._sink is not None
            return self._sink.take()

    def finish(self) -> bytes:
        if self.fmt in ("wav", "pcm"):
            return b""
        with self._lock:
            if self._file is None:
                return encode_whole(self.fmt, bytes(self._pcm), self.sample_rate)
            self._file.close()
            assert self._sink is not None
            return self._sink.take()

    def close(self) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.close()


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_audio_delta(chunk: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})


def sse_audio_done(usage: dict) -> bytes:
    return sse_event({"type": "speech.audio.done", "usage": usage})


def sse_error(message: str) -> bytes:
    return sse_event({"type": "error", "error": {"message": message}})
