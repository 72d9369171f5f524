"""Audio on the wire: OpenAI's 24 kHz, WAV headers, compressed containers (libsndfile, FFmpeg),
SSE events.

The pipeline produces 16-bit little-endian mono PCM at the model's rate; everything here
resamples it to OUTPUT_RATE (OpenAI's rate for every response_format) and wraps or encodes it.
FLAC, Ogg Opus and MP3 come from libsndfile through soundfile (its wheels bundle libsndfile
with FLAC, Opus and LAME); AAC from FFmpeg's native encoder through PyAV (its wheels bundle
FFmpeg), in ADTS frames, the raw AAC stream OpenAI's `aac` is. PyAV is the `aac` extra
(scripts/setup installs it): imported when an aac answer is made, so a replica without it
serves every other format and answers aac with a 400 that says what to install.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib
import io
import json
import struct
import threading

import numpy as np
import samplerate
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
# Every response_format, headered or not, is 24 kHz 16-bit mono, as OpenAI's are: clients take
# pcm at that word (it has no header to say otherwise), and one rate for every format keeps
# X-Sample-Rate one number and Ogg Opus (which has no 22,050 Hz) on the same path as the rest.
# A model at another rate (a Piper voice's 22,050 Hz) is resampled; the presets' 24 kHz is
# passed through untouched, byte for byte (docs/contracts.md).
OUTPUT_RATE = 24000
# libsamplerate (BSD-2-Clause) through `samplerate` (MIT; its wheels bundle the library): a
# maintained band-limited (sinc) converter, and a stateful one, so a stream resampled chunk by
# chunk is the whole file's resampling sample for sample (no seam at a sentence's edge, the same
# bytes however the audio was cut). Not soxr: LGPL, which the Apache-2.0 core does not import;
# not scipy's resample_poly: stateless (each chunk's edges would need stitching by hand), and
# a 35 MB download for one function. The medium sinc keeps 90 % of the band (9.9 kHz of
# 11 kHz); the voice has under 1e-6 of its energy above 9 kHz, where it and the best differ,
# and its speech comes out 73 dB (SNR) from the best's, at a third of the CPU: 0.0034 CPU s
# per second of audio on a 2-core Xeon (bench/results/resample.md).
RESAMPLER_CONVERTER = "sinc_medium"


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
    """One response's PCM from `rate_in` to `rate_out`, chunk by chunk.

    `__call__(samples)` per chunk, `finish()` once at the end. The converter keeps its filter's
    look-ahead between calls, so the output lags the input by a few ms until `finish` flushes
    it, and the chunks' outputs joined are exactly one call's on the whole input, whatever the
    cuts: no clicks at sentence edges, and the bytes are a function of the input alone (a
    resumable answer's offsets stay true). In all, round(n × rate_out / rate_in) samples.
    Equal rates pass the samples through as they are, without the converter.
    """

    # Input samples per converter call: `samplerate` holds the GIL while it converts, so a
    # sentence is converted in slices of 0.37 s of audio (about 1.3 ms of CPU each), between
    # which the event loop gets the GIL back.
    BLOCK = 8192
    # Zeros fed after the last sample, with end-of-input, to flush the converter's look-ahead
    # (a few hundred samples at most for libsamplerate's converters): its binding sizes the
    # output it returns by the input it is given, so an empty end-of-input call returns nothing.
    FLUSH = 4096

    def __init__(self, rate_in: int, rate_out: int, converter: str = RESAMPLER_CONVERTER) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self.identity = rate_in == rate_out
        self._ratio = rate_out / rate_in
        # `converter`: another of libsamplerate's, for bench/resample.py to compare
        self._converter = None if self.identity else samplerate.Resampler(converter, 1)
        self._taken = 0  # input samples so far
        self._given = 0  # output samples so far

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        if self.identity:
            return samples
        self._taken += len(samples)
        out = [self._convert(samples[i:i + self.BLOCK], end=False)
               for i in range(0, len(samples), self.BLOCK)]
        return self._give(np.concatenate(out) if out else np.zeros(0, dtype="<i2"))

    def finish(self) -> np.ndarray:
        """The samples the converter still holds, to make round(n × rate_out / rate_in)."""
        if self.identity:
            return np.zeros(0, dtype="<i2")
        total = (self._taken * self.rate_out + self.rate_in // 2) // self.rate_in
        tail = self._convert(np.zeros(self.FLUSH, dtype="<i2"), end=True)[:total - self._given]
        if len(tail) < total - self._given:  # not with libsamplerate's look-ahead: a guard
            tail = np.concatenate([tail, np.zeros(total - self._given - len(tail), "<i2")])
        return self._give(tail)

    def _convert(self, samples: np.ndarray, *, end: bool) -> np.ndarray:
        assert self._converter is not None
        out = self._converter.process(samples.astype(np.float32) / 32768, self._ratio,
                                      end_of_input=end)
        return np.clip(np.rint(out * 32768), -32768, 32767).astype("<i2")

    def _give(self, out: np.ndarray) -> np.ndarray:
        self._given += len(out)
        return out


def resample_whole(pcm: bytes, rate_in: int, rate_out: int = OUTPUT_RATE) -> bytes:
    """A whole response's PCM at `rate_out`: the same bytes as Resampler chunk by chunk."""
    resampler = Resampler(rate_in, rate_out)
    if resampler.identity:
        return pcm
    return resampler(_samples(pcm)).tobytes() + resampler.finish().tobytes()


def takes_cpu(fmt: str, sample_rate: int) -> bool:
    """Whether making `fmt` from PCM at `sample_rate` takes real CPU: an encoder, or the
    resampler (tens of ms per second of audio for an encoder, a few for the resampler); the
    server runs those off the event loop."""
    return fmt in _ENCODED or sample_rate != OUTPUT_RATE


def encode_whole(fmt: str, pcm: bytes, sample_rate: int) -> bytes:
    """One complete file of `fmt` at OUTPUT_RATE from PCM at the model's `sample_rate`; where
    `takes_cpu` says so, call it off the event loop."""
    pcm = resample_whole(pcm, sample_rate)
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(OUTPUT_RATE, len(pcm)) + pcm
    out = io.BytesIO()
    with _open_encoder(fmt, out, OUTPUT_RATE) as sink:
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
    """Turns a request's PCM chunks, at the model's `sample_rate`, into the bytes of `fmt` at
    OUTPUT_RATE to send, as they can be sent.

    `header()` first, `feed(chunk)` per chunk, `finish()` at the end (each may return b"");
    `close()` on any path. `blocking` says feed/finish take real CPU (run them in a thread):
    a lock makes a close from the event loop wait for a feed still running in one.
    """

    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.fmt = fmt
        self.sample_rate = OUTPUT_RATE  # of the bytes sent: X-Sample-Rate
        self.model_rate = sample_rate
        self.blocking = takes_cpu(fmt, sample_rate)
        self._lock = threading.Lock()
        self._pcm = bytearray()  # flac, mp3: the whole request, encoded at the end
        self._sink: _AppendOnly | None = None
        self._file: soundfile.SoundFile | AdtsFile | None = None
        # One per response: its state is what joins one chunk's samples to the next's.
        self._resample = Resampler(sample_rate, OUTPUT_RATE)
        if fmt in ("opus", "aac"):
            self._sink = _AppendOnly()
            self._file = _open_encoder(fmt, self._sink, OUTPUT_RATE)

    def header(self) -> bytes:
        return wav_header(OUTPUT_RATE, None) if self.fmt == "wav" else b""

    def feed(self, pcm: bytes) -> bytes:
        with self._lock:
            if self.fmt in ("wav", "pcm"):
                return pcm if self._resample.identity else self._resample(_samples(pcm)).tobytes()
            if self._file is None:
                self._pcm += pcm
                return b""
            self._file.write(self._resample(_samples(pcm)))
            assert self._sink is not None
            return self._sink.take()

    async def feed_async(self, pcm: bytes) -> bytes:
        """feed, off the event loop where it takes real CPU (`blocking`)."""
        return await asyncio.to_thread(self.feed, pcm) if self.blocking else self.feed(pcm)

    async def finish_async(self) -> bytes:
        """finish, off the event loop where it takes real CPU (`blocking`)."""
        return await asyncio.to_thread(self.finish) if self.blocking else self.finish()

    def finish(self) -> bytes:
        with self._lock:
            if self.fmt in ("wav", "pcm"):
                return self._resample.finish().tobytes()
            if self._file is None:
                return encode_whole(self.fmt, bytes(self._pcm), self.model_rate)
            self._file.write(self._resample.finish())
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
