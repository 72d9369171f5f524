"""engine/audio.py's AAC, without a replica: ADTS frames from FFmpeg's encoder (PyAV), streamed
as they are encoded, decoding back to the input's waveform and duration."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from omni_dp.engine.audio import AAC_BIT_RATE, StreamEncoder, encode_whole

RATE = 24000
PRIMING = 1024  # the AAC encoder's delay: samples of silence before the input's first
FRAME = 1024  # samples per AAC frame


def sine(seconds: float) -> bytes:
    t = np.arange(int(RATE * seconds))
    return (np.sin(2 * np.pi * 440 * t / RATE) * 8000).astype("<i2").tobytes()


def decode(aac: bytes) -> tuple[np.ndarray, av.audio.stream.AudioStream]:
    with av.open(io.BytesIO(aac), format="adts") as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray()[0] for f in container.decode(stream)]
        return np.concatenate(frames), stream


@pytest.mark.parametrize("seconds", [0.05, 1.3])
def test_aac_decodes_to_the_input_at_its_duration(seconds):
    pcm = sine(seconds)
    n = len(pcm) // 2
    samples, stream = decode(encode_whole("aac", pcm, RATE))
    assert (stream.codec_context.name, stream.sample_rate, stream.channels) == ("aac", RATE, 1)
    # The priming, then the input, padded to a whole frame: ADTS has no field to trim either.
    assert len(samples) == -(-(PRIMING + n) // FRAME) * FRAME
    source = np.frombuffer(pcm, "<i2") / 32768
    heard = samples[PRIMING:PRIMING + n]
    assert np.corrcoef(heard, source)[0, 1] > 0.99


def test_aac_streams_frames_as_they_are_encoded_and_equals_the_whole_file():
    pcm = sine(2.0)
    encoder = StreamEncoder("aac", RATE)
    assert encoder.blocking and encoder.header() == b""
    parts = [encoder.feed(pcm[i:i + 9600]) for i in range(0, len(pcm), 9600)]
    parts.append(encoder.finish())
    encoder.close()
    assert sum(1 for p in parts[:-1] if p) >= 5  # out before the end, not held to the finish
    streamed = b"".join(parts)
    assert streamed == encode_whole("aac", pcm, RATE)
    assert streamed[:2] == b"\xff\xf1"  # an ADTS sync word: MPEG-4, no CRC
    # 64 kbit/s, give or take the encoder's rate control and the ADTS headers.
    assert len(streamed) * 8 / 2.0 == pytest.approx(AAC_BIT_RATE, rel=0.25)


def test_an_aac_stream_closed_early_writes_no_more():
    encoder = StreamEncoder("aac", RATE)
    encoder.feed(sine(0.5))
    encoder.close()
    encoder.close()  # idempotent: the server closes on every path
