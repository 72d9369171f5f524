"""The trained voice (22,050 Hz) answers at OpenAI's 24 kHz, through the replica's HTTP server
run in this process: pcm raw, streamed or whole, and in SSE deltas, is the voice's audio
resampled as one stream (the same bytes every way, its length the voice's duration at 24 kHz);
every headered format's header gives the rate X-Sample-Rate gives; and the recognizer hears the
24 kHz pcm as well as the voice's own 22,050 Hz WAV of the same synthesis.

The voice: joe's graph under a config with its noise scales at zero, so every answer is the
same audio and a test can compute it (joe's own config draws noise in the graph: no two answers
alike, docs/voice.md). Only the noise differs from joe; the rate, the graph and the sentences
are its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import signal

import av
import numpy as np
import pytest
import soundfile

from omni_dp.engine.audio import OUTPUT_RATE, resample_whole, wav_header
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import plan_serve
from omni_dp.engine.voice.model import VoiceSession, find_voice, pcm16
from omni_dp.engine.voice.phonemes import phoneme_ids, phonemize, split_sentences

from support.audio import first_difference
from support.http_client import client
from support.recognizer import require_voice, transcribe, word_recall

TEXT = "Hello there. The weather is nice today."  # two sentences: two chunks to join
VOICE_RATE = 22050
RECALL_TEXTS = (
    "Please call me back in the morning.",
    "The weather is very nice today, so we will walk to the station.",
    "Thank you very much for your help.",
    "Several replicas share one machine behind a router.",
)


@pytest.fixture(scope="module")
def quiet_voice(tmp_path_factory) -> str:
    """A Piper voice directory: joe's graph, its config with noise_scale and noise_w at 0."""
    require_voice()
    joe = find_voice("joe")
    assert joe.sample_rate == VOICE_RATE  # the point: not 24 kHz
    directory = tmp_path_factory.mktemp("quiet-joe")
    (directory / "quiet.onnx").symlink_to(joe.onnx_path)
    config = json.loads(joe.config_path.read_text())
    config["inference"] = {**config.get("inference", {}), "noise_scale": 0.0, "noise_w": 0.0}
    (directory / "quiet.onnx.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def quiet_native(quiet_voice) -> bytes:
    """The quiet voice's own PCM of TEXT: what every answer is made of."""
    return spoken(quiet_voice, TEXT)


def spoken(spec: str, text: str) -> bytes:
    """The voice's own PCM (its rate) for `text`, sentence by sentence as the pipeline speaks."""
    voice = find_voice(spec)
    session = VoiceSession(voice, "cpu")
    return b"".join(
        pcm16(session.run(phoneme_ids(phonemize(sentence, voice.espeak_voice),
                                      voice.phoneme_id_map),
                          length_scale=voice.length_scale, speaker=0))
        for sentence in split_sentences(text))


@contextlib.asynccontextmanager
async def served(model: str):
    """The replica's server on a free loopback port in this event loop; stopped by SIGTERM's
    handler."""
    from omni_dp.engine.server import ReplicaServer, State, bind_socket

    server = ReplicaServer(plan_serve(ServeOptions(model=model, device="cpu", threads=1)))
    sock = bind_socket("127.0.0.1", 0)
    running = asyncio.create_task(server.run(sock))
    try:
        for _ in range(600):  # the graph loads in well under a second; 30 s at most
            if server.state != State.STARTING or running.done():
                break
            await asyncio.sleep(0.05)
        assert server.state == State.READY, f"the voice did not start: {server.state}"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(running, 30)


ASKS = {  # name -> the body's fields besides input
    "pcm streamed": {"response_format": "pcm", "stream": True},
    "pcm whole": {"response_format": "pcm", "stream": False},
    "pcm sse": {"response_format": "pcm", "stream": True, "stream_format": "sse"},
    **{f"{fmt} whole": {"response_format": fmt, "stream": False}
       for fmt in ("wav", "flac", "opus", "mp3", "aac")},
    **{f"{fmt} streamed": {"response_format": fmt, "stream": True}
       for fmt in ("wav", "opus", "aac")},
}


@pytest.fixture(scope="module")
def answers(quiet_voice) -> dict[str, tuple[int, dict, bytes]]:
    """Every ask's (status, headers, body) from one replica of the quiet voice."""

    async def scenario():
        async with served(quiet_voice) as url, client() as session:
            async with session.get(url + "/get_server_info") as response:
                found = {"server info": (response.status, dict(response.headers),
                                         await response.read())}
            for name, fields in ASKS.items():
                async with session.post(url + "/v1/audio/speech",
                                        json={"input": TEXT, **fields}) as response:
                    found[name] = response.status, dict(response.headers), await response.read()
            return found

    return asyncio.run(scenario())


def sse_audio(body: bytes) -> tuple[bytes, dict]:
    """The audio of an SSE answer's deltas, joined, and its done event's usage."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events
                     if e["type"] == "speech.audio.delta")
    done = [e for e in events if e["type"] == "speech.audio.done"]
    assert len(done) == 1, events[-1]
    return audio, done[0]["usage"]


def test_the_voice_pcm_is_24khz_streamed_whole_and_in_sse(quiet_native, answers):
    """pcm is OpenAI's 24 kHz from a 22,050 Hz voice: X-Sample-Rate says 24000 and the bytes
    are the voice's audio resampled as one stream, round(n × 24000 / 22050) samples, the same
    streamed, whole and in SSE deltas; usage's audio_seconds stays the voice's duration."""
    native = quiet_native
    expected = resample_whole(native, VOICE_RATE)
    assert len(expected) // 2 == round(len(native) // 2 * OUTPUT_RATE / VOICE_RATE)
    for name in ("pcm streamed", "pcm whole", "pcm sse"):
        status, headers, body = answers[name]
        assert status == 200, (name, body[:300])
        assert headers["X-Sample-Rate"] == str(OUTPUT_RATE), name
        audio = body
        if name == "pcm sse":
            audio, usage = sse_audio(body)
            assert usage["audio_seconds"] == pytest.approx(len(native) / 2 / VOICE_RATE)
        assert first_difference(audio, expected) is None, (name, len(audio), len(expected))


def rate_in_header(fmt: str, body: bytes) -> tuple[int, float]:
    """(the rate the file's own header gives, its decoded duration in seconds)."""
    if fmt == "aac":
        with av.open(io.BytesIO(body), format="adts") as container:
            stream = container.streams.audio[0]
            count = sum(f.samples for f in container.decode(stream))
            return stream.sample_rate, count / stream.sample_rate
    samples, rate = soundfile.read(io.BytesIO(body), dtype="int16")
    return rate, len(samples) / rate


@pytest.mark.parametrize("name", [n for n in ASKS if not n.startswith("pcm")])
def test_a_headered_format_of_the_voice_says_in_its_header_the_rate_x_sample_rate_says(
        quiet_native, answers, name):
    """docs/contracts.md: every format is 24 kHz, so the header and X-Sample-Rate agree, and
    the audio is the voice's duration (aac: plus priming and padding, < 0.09 s). Ogg Opus was
    24 kHz in its header under an X-Sample-Rate of 22050 before."""
    status, headers, body = answers[name]
    assert status == 200, body[:300]
    fmt = name.split()[0]
    rate, seconds = rate_in_header(fmt, body)
    assert rate == int(headers["X-Sample-Rate"]) == OUTPUT_RATE
    voice_seconds = len(quiet_native) / 2 / VOICE_RATE
    assert voice_seconds - 0.001 <= seconds < voice_seconds + 0.09


def test_wav_carries_the_same_samples_as_pcm(answers):
    """The lossless formats are the pcm's samples: the same resampling under every header."""
    pcm = answers["pcm whole"][2]
    flac = soundfile.read(io.BytesIO(answers["flac whole"][2]), dtype="int16")[0].tobytes()
    assert first_difference(answers["wav whole"][2], wav_header(OUTPUT_RATE, len(pcm)) + pcm) \
        is None
    assert first_difference(answers["wav streamed"][2][44:], pcm) is None
    assert first_difference(flac, pcm) is None


def test_the_recognizer_hears_the_24khz_pcm_as_well_as_the_voices_own_wav(quiet_voice):
    """Resampling costs no intelligibility: the same synthesis, heard at the voice's 22,050 Hz
    and as the 24 kHz pcm, recalls as many words, give or take two of 35 (the recognizer's own
    resampling to 16 kHz starts from another grid, and its result moves a word or two with the
    CPU's float rounding: CI heard 28 of 35 where this machine heard 30). The quiet voice, as
    joe's own noise drew another synthesis, and so another recall, on each run."""
    require_voice()
    heard = {"native": [0, 0], "24 kHz": [0, 0]}
    for text in RECALL_TEXTS:
        native = spoken(quiet_voice, text)
        pcm = resample_whole(native, VOICE_RATE)
        for key, wav in (("native", wav_header(VOICE_RATE, len(native)) + native),
                         ("24 kHz", wav_header(OUTPUT_RATE, len(pcm)) + pcm)):
            hits, total = word_recall(text, transcribe(wav))
            heard[key][0] += hits
            heard[key][1] += total
    (native_hits, total), (hits, _) = heard["native"], heard["24 kHz"]
    assert native_hits >= 0.6 * total, heard  # the recognizer hears the voice at all
    assert hits >= native_hits - 2, heard


def test_the_24khz_pcm_is_the_voices_signal_resampled_not_merely_relabelled(quiet_native):
    """The precise guard under the recognizer's loose one: the 24 kHz pcm, brought back to
    22,050 Hz, is the voice's own signal to within 40 dB (a sinc resampler keeps the band
    below 11 kHz whole; linear interpolation, a dropped sample or a shifted one does not)."""
    pcm = resample_whole(quiet_native, VOICE_RATE)
    assert len(pcm) // 2 == round(len(quiet_native) // 2 * OUTPUT_RATE / VOICE_RATE)
    back = np.frombuffer(resample_whole(pcm, OUTPUT_RATE, VOICE_RATE), "<i2").astype(float)
    voice = np.frombuffer(quiet_native, "<i2").astype(float)
    edge = VOICE_RATE // 20  # the filters' start and end: 50 ms each side
    signal_, error = voice[edge:-edge], back[edge:len(voice) - edge] - voice[edge:-edge]
    snr_db = 10 * np.log10(np.sum(signal_ ** 2) / np.sum(error ** 2))
    assert snr_db > 40, snr_db


def test_server_info_says_the_rate_answers_are_in_beside_the_voices_own(answers):
    """A client that asks the replica what rate to play pcm at is told 24000 (what
    X-Sample-Rate says), not the voice's own 22,050 Hz, which stays model.sample_rate."""
    status, _, body = answers["server info"]
    info = json.loads(body)
    assert status == 200
    assert info["output_sample_rate"] == OUTPUT_RATE == int(answers["pcm whole"][1][
        "X-Sample-Rate"])
    assert info["model"]["sample_rate"] == VOICE_RATE
