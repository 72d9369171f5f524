"""engine/audio.py without a replica: every format at OpenAI's 24 kHz (a model at another rate
resampled, whole or chunk by chunk to the same bytes; the presets' 24 kHz passed through byte for
byte) and saying so in its header; AAC's ADTS frames from FFmpeg's encoder (PyAV), streamed as
they are encoded, decoding back to the input's waveform and duration."""

from __future__ import annotations

import io
import itertools

import av
import numpy as np
import pytest
import soundfile

from omni_dp.engine.audio import (
    AAC_BIT_RATE,
    OUTPUT_RATE,
    STREAMED_FORMATS,
    Resampler,
    StreamEncoder,
    encode_whole,
)

from support.audio import first_difference

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


# --- OpenAI's 24 kHz ------------------------------------------------------------------------

VOICE_RATE = 22050  # a Piper voice's
HEADERED = ("wav", "flac", "opus", "mp3", "aac")


def tone(rate: int, seconds: float, hz: float = 3000.0) -> np.ndarray:
    """A tone sampled at `rate`: the same sound at any rate, so a resampling is checked against
    the tone sampled at the new rate (3 kHz: linear interpolation misses it by ~20 dB)."""
    t = np.arange(int(rate * seconds)) / rate
    return np.round(np.sin(2 * np.pi * hz * t) * 8000).astype("<i2")


def streamed(fmt: str, pcm: bytes, rate: int, cuts: list[int]) -> tuple[list[bytes], int]:
    """The parts a StreamEncoder sends for `pcm` fed in chunks ending at `cuts`, and its rate."""
    encoder = StreamEncoder(fmt, rate)
    try:
        edges = [0, *cuts, len(pcm)]
        parts = [encoder.header()]
        parts += [encoder.feed(pcm[a:b]) for a, b in itertools.pairwise(edges)]
        parts.append(encoder.finish())
        return parts, encoder.sample_rate
    finally:
        encoder.close()


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    error = got.astype(float) - want.astype(float)
    return float(10 * np.log10(np.sum(want.astype(float) ** 2) / max(np.sum(error**2), 1e-9)))


def test_pcm_of_a_model_at_another_rate_is_openai_24khz_whole_and_streamed():
    """OpenAI's pcm is 24 kHz whatever the model: a 22,050 Hz voice's is resampled, to
    round(n × 24000 / 22050) samples that are the tone sampled at 24 kHz (no pitch shift, no
    seam where the chunks (sentences) join), the same bytes whole and however it was cut."""
    source = tone(VOICE_RATE, 1.5)
    pcm = source.tobytes()
    whole = encode_whole("pcm", pcm, VOICE_RATE)
    assert len(whole) // 2 == round(len(source) * OUTPUT_RATE / VOICE_RATE) == 36000
    got, want = np.frombuffer(whole, "<i2"), tone(OUTPUT_RATE, 1.5)
    assert snr_db(got[64:-64], want[64:-64]) > 70
    # The converter sees silence past either end, so the first and last samples are the tone
    # less closely, but the tone: the last ones were held back until the stream's end.
    assert snr_db(got[:16], want[:16]) > 20 and snr_db(got[-16:], want[-16:]) > 20
    for cuts in ([2, 4411 * 2, 30001 * 2], list(range(1000, len(pcm), 1000))):
        parts, rate = streamed("pcm", pcm, VOICE_RATE, cuts)
        assert rate == OUTPUT_RATE and first_difference(b"".join(parts), whole) is None
        assert sum(1 for p in parts[1:-1] if p) >= len(cuts)  # sent as it comes, not at the end
    wav = encode_whole("wav", pcm, VOICE_RATE)
    assert first_difference(wav[44:], whole) is None
    assert soundfile.info(io.BytesIO(wav)).samplerate == OUTPUT_RATE


def test_a_stream_is_resampled_by_one_converter_whose_chunks_join_as_one():
    """The resampler keeps its filter's state between chunks: sample-sized chunks give exactly
    the whole resampling (a fresh converter per chunk would restart its filter at each join: a
    click at every sentence's edge); it holds back only its look-ahead until finish."""
    source = tone(VOICE_RATE, 0.25, hz=440)
    whole = Resampler(VOICE_RATE, OUTPUT_RATE)
    expected = np.concatenate([whole(source), whole.finish()])
    resampler = Resampler(VOICE_RATE, OUTPUT_RATE)
    parts = [resampler(source[i:i + 7]) for i in range(0, len(source), 7)]
    held = round(len(source) * OUTPUT_RATE / VOICE_RATE) - sum(map(len, parts))
    assert 0 < held < 0.01 * OUTPUT_RATE  # a few ms held back, not the stream
    assert np.array_equal(np.concatenate([*parts, resampler.finish()]), expected)


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_a_24khz_model_is_passed_through_byte_for_byte(fmt):
    """The seeded presets are 24 kHz already: their bytes are the vocoder's, unresampled (a
    resumable answer is regenerated byte for byte), and cost no thread."""
    pcm = np.random.default_rng(0).integers(-20000, 20000, OUTPUT_RATE, dtype="<i2").tobytes()
    header = 44 if fmt == "wav" else 0
    assert first_difference(encode_whole(fmt, pcm, OUTPUT_RATE)[header:], pcm) is None
    parts, rate = streamed(fmt, pcm, OUTPUT_RATE, [2, 1000, 30000])
    assert rate == OUTPUT_RATE and parts[-1] == b""
    assert [first_difference(a, b) for a, b in zip(
        parts[1:4], [pcm[:2], pcm[2:1000], pcm[1000:30000]], strict=True)] == [None] * 3
    assert first_difference(b"".join(parts)[header:], pcm) is None
    assert not StreamEncoder(fmt, OUTPUT_RATE).blocking


def header_rate(fmt: str, body: bytes) -> tuple[int, float]:
    """(the sample rate the file's own header gives, its decoded duration in seconds)."""
    if fmt == "aac":
        samples, stream = decode(body)
        return stream.sample_rate, len(samples) / stream.sample_rate
    info = soundfile.info(io.BytesIO(body))
    frames = len(soundfile.read(io.BytesIO(body), dtype="int16")[0])  # a streamed WAV's too
    return info.samplerate, frames / info.samplerate


@pytest.mark.parametrize("model_rate", [VOICE_RATE, OUTPUT_RATE])
@pytest.mark.parametrize("fmt", HEADERED)
def test_every_headered_format_is_24khz_and_its_header_says_so(fmt, model_rate):
    """One rule for every format (docs/contracts.md): 24 kHz, so the rate X-Sample-Rate gives
    (the encoder's sample_rate) is the one the file's header gives, whole and streamed, and the
    audio keeps its duration (aac: plus its priming and last frame's padding, < 0.09 s)."""
    seconds = 1.0
    pcm = tone(model_rate, seconds, hz=440).tobytes()
    bodies = {"whole": encode_whole(fmt, pcm, model_rate)}
    parts, rate = streamed(fmt, pcm, model_rate, [9600, 20000])
    assert rate == OUTPUT_RATE
    bodies["streamed"] = b"".join(parts)
    if fmt in STREAMED_FORMATS:
        assert any(parts[1:-1]), "sent as it was fed"
    for how, body in bodies.items():
        in_header, duration = header_rate(fmt, body)
        assert in_header == OUTPUT_RATE, (how, in_header)
        assert seconds <= duration < seconds + 0.09 if fmt == "aac" else \
            duration == pytest.approx(seconds, abs=1 / model_rate), (how, duration)
