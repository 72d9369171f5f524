"""A replica as OpenAI clients see it: the official SDK, streaming by default, SSE, `speed`,
encoded formats, `model`, and HTTP/1.0 clients. Real replica processes on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import signal
import socket
import subprocess
import time
import wave
from typing import get_args
from urllib.parse import urlsplit

import av
import openai
import pytest
import soundfile

from omni_dp.engine.api import OPENAI_MODEL_ALIASES
from omni_dp.engine.config import PRESETS
from omni_dp.engine.preprocess import VOICES

from support.http_client import get, post_json
from support.router import make_config, serve
from support.wait import until

SPEECH = "/v1/audio/speech"
TINY = PRESETS["tiny"]
TEXT = "Clients work unchanged."


def speak(replica, **body) -> tuple[int, dict, bytes]:
    body.setdefault("input", TEXT)
    return post_json(replica.url + SPEECH, body)


def pcm_of(replica, **body) -> bytes:
    """The reference audio: a buffered pcm response to the same request."""
    status, _, pcm = speak(replica, **{**body, "response_format": "pcm", "stream": False})
    assert status == 200, pcm
    return pcm


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(lines) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def http10(url: str, body: dict, timeout: float = 120) -> tuple[bytes, dict, bytes]:
    """One HTTP/1.0 POST on a raw socket, read until the server closes the connection."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(b"POST " + SPEECH.encode() + b" HTTP/1.0\r\nContent-Type: application/json"
                     b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return status_line.encode(), headers, payload


# --- the SDK, streaming and SSE --------------------------------------------------------------


def test_sdk_create_returns_the_audio(replica):
    audio = sdk(replica.url).audio.speech.create(
        model="tts-1", voice="nova", input=TEXT, response_format="pcm")
    assert audio.content == pcm_of(replica, voice="nova")


def test_sdk_streaming_response_streams_by_default(replica):
    with sdk(replica.url).audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm") as resp:
        assert resp.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in resp.headers
        chunks = list(resp.iter_bytes())
    assert b"".join(chunks) == pcm_of(replica)


def test_stream_false_still_gives_one_buffered_body(replica):
    status, headers, body = speak(replica, response_format="pcm", stream=False)
    assert status == 200
    assert int(headers["Content-Length"]) == len(body)
    assert "Transfer-Encoding" not in headers


def test_sdk_stream_format_sse_alone_gives_openai_events(replica):
    with sdk(replica.url).audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="alloy", input=TEXT, response_format="pcm",
            stream_format="sse") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    pcm = pcm_of(replica)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert list(usage)[:3] == ["input_tokens", "output_tokens", "total_tokens"]
    assert usage["input_tokens"] == len(TEXT.encode()) + 4  # speaker, bos, eos, bos_audio
    assert usage["output_tokens"] == len(pcm) // 2 // TINY.vocoder.samples_per_token
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["audio_seconds"] == pytest.approx(len(pcm) / 2 / TINY.sample_rate)


def test_sdk_streams_sse_through_the_router(replica):
    async def run() -> list[dict]:
        async with serve(make_config([replica.url], interval=0.2)) as served:
            await until(lambda: bool(served.router.replicas.routable()), 10, "replica routable")
            client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused",
                                        max_retries=0)
            async with client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                    stream_format="sse") as resp:
                events = sse_events([line async for line in resp.iter_lines()])
            await client.close()
            return events

    events = asyncio.run(asyncio.wait_for(run(), 60))
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio == pcm_of(replica)
    assert events[-1]["type"] == "speech.audio.done"


def test_python_wave_reads_a_streamed_wav_to_its_end_and_a_buffered_one_exactly(
        replica, tmp_path):
    """What docs/contracts.md promises a WAV reader: a streamed WAV's sizes are 0xFFFFFFFF (its
    length is unknown when the header goes out; OpenAI's streamed WAV has the same), so Python's
    `wave` reads every frame to the end of the body while reporting 2**31 - 1 frames; a
    buffered one (`stream: false`) has the exact sizes, for `wave` and for soxi."""
    pcm = pcm_of(replica)
    with sdk(replica.url).audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="wav") as resp:
        assert resp.headers.get("transfer-encoding") == "chunked"
        streamed = resp.read()
    with wave.open(io.BytesIO(streamed)) as reader:
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (
            1, 2, TINY.sample_rate)
        assert reader.getnframes() == 0xFFFFFFFF // 2  # the size field says "unknown"
        assert reader.readframes(reader.getnframes()) == pcm  # every frame, and no more
    _, _, whole = speak(replica, response_format="wav", stream=False)
    with wave.open(io.BytesIO(whole)) as reader:
        assert reader.getnframes() == len(pcm) // 2
        assert reader.readframes(reader.getnframes()) == pcm
    assert whole[44:] == streamed[44:]  # the same samples; only the two size fields differ
    soxi = shutil.which("soxi")
    if soxi is not None:  # where sox is installed (it is not a dependency): the same reading
        path = tmp_path / "whole.wav"
        path.write_bytes(whole)
        samples = subprocess.run([soxi, "-s", str(path)], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
        assert int(samples) == len(pcm) // 2


# --- speed -----------------------------------------------------------------------------------


def test_speed_scales_the_duration(replica):
    body = {"input": "A sentence long enough for its length to show.", "seed": 11}
    normal = pcm_of(replica, **body)
    assert pcm_of(replica, **body, speed=1.0) == normal  # 1.0 is exactly the default
    fast = sdk(replica.url).audio.speech.create(
        model="tts-1", voice="alloy", response_format="pcm", speed=2.0, extra_body={"seed": 11},
        input=body["input"]).content
    slow = pcm_of(replica, **body, speed=0.5)
    assert 0 < len(fast) <= 0.6 * len(normal)
    assert len(slow) >= 1.6 * len(normal)


@pytest.mark.parametrize("speed", [0.2, 4.5, "fast"])
def test_speed_out_of_range_is_400_naming_it(replica, speed):
    status, _, body = speak(replica, speed=speed)
    assert status == 400
    assert json.loads(body)["error"]["param"] == "speed"


# --- encoded formats -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["flac", "opus", "mp3"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_encoded_formats_decode_to_the_same_audio(replica, fmt, stream):
    pcm = pcm_of(replica)
    status, headers, body = speak(replica, response_format=fmt, stream=stream)
    assert status == 200, body
    assert headers["Content-Type"] == {"flac": "audio/flac", "opus": "audio/ogg",
                                       "mp3": "audio/mpeg"}[fmt]
    samples, rate = soundfile.read(io.BytesIO(body), dtype="int16", always_2d=True)
    assert rate == TINY.sample_rate
    assert samples.shape == (len(pcm) // 2, 1)  # mono, and exactly the PCM's duration
    if fmt == "flac":  # lossless
        assert samples[:, 0].tobytes() == pcm


def test_opus_is_streamed_as_decoded_and_flac_mp3_are_sent_whole(replica):
    body = {"max_new_tokens": 300, "seed": 5}
    _, headers, _ = speak(replica, response_format="opus", **body)
    assert headers.get("Transfer-Encoding") == "chunked"
    for fmt in ("flac", "mp3"):
        _, headers, whole = speak(replica, response_format=fmt, **body)
        assert int(headers["Content-Length"]) == len(whole)
        assert speak(replica, response_format=fmt, stream=False, **body)[2] == whole


def test_encoded_formats_inside_sse(replica):
    status, _, body = speak(replica, response_format="opus", stream_format="sse")
    assert status == 200
    events = sse_events(body.decode().split("\n\n"))
    opus = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    samples, rate = soundfile.read(io.BytesIO(opus), dtype="int16")
    assert (rate, len(samples)) == (TINY.sample_rate, len(pcm_of(replica)) // 2)


def test_sdk_gets_flac(replica):
    audio = sdk(replica.url).audio.speech.create(
        model="tts-1-hd", voice="alloy", input=TEXT, response_format="flac")
    samples, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == TINY.sample_rate and samples.tobytes() == pcm_of(replica)


def aac_samples(aac: bytes) -> int:
    """Samples an AAC (ADTS) body decodes to, by FFmpeg's decoder (PyAV)."""
    with av.open(io.BytesIO(aac), format="adts") as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.sample_rate) == ("aac", TINY.sample_rate)
        return sum(frame.samples for frame in container.decode(stream))


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_sdk_gets_aac_at_the_audio_duration(replica, stream):
    n = len(pcm_of(replica, voice="verse")) // 2
    with sdk(replica.url).audio.speech.with_streaming_response.create(
            model="tts-1", voice="verse", input=TEXT, response_format="aac",
            extra_body={"stream": stream}) as response:
        assert response.headers["Content-Type"] == "audio/aac"
        assert ("Content-Length" in response.headers) == (not stream)
        aac = response.read()
    # The encoder's 1024 samples of priming, then the audio, padded to a whole 1024-sample frame
    # (ADTS has no field to trim either).
    assert aac_samples(aac) == -(-(1024 + n) // 1024) * 1024


# --- model -----------------------------------------------------------------------------------


def test_models_served_aliased_absent_and_unknown(start_replica):
    replica = start_replica("--served-model-name", "house-voice")
    models = json.loads(get(replica.url + "/v1/models")[2])["data"]
    # The served model first (a client taking the first entry gets it), then every alias the
    # endpoint accepts, from the one table of them: what is listed is what is accepted.
    assert [m["id"] for m in models] == ["house-voice", *OPENAI_MODEL_ALIASES]
    assert {m["root"] for m in models} == {"house-voice"}
    reference = speak(replica, response_format="pcm")[2]
    for model in [m["id"] for m in models]:
        assert speak(replica, response_format="pcm", model=model)[2] == reference
    assert [m.id for m in sdk(replica.url).models.list()] == [m["id"] for m in models]

    status, _, body = speak(replica, model="omni-dp-tiny")  # the default name, not served here
    assert status == 404
    assert json.loads(body) == {"error": {
        "message": "The model `omni-dp-tiny` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        sdk(replica.url).audio.speech.create(model="whisper-1", voice="alloy", input=TEXT)
    assert replica.metric('omni_dp_speech_requests_total{outcome="bad_request"}') == 2


def test_every_openai_voice_speaks_on_a_replica(replica):
    """All of OpenAI's voices through the SDK; with no seed, each sounds different, also the
    ones that share a speaker of the 8-speaker model (their names seed them apart)."""
    from openai.types.audio.speech_create_params import Voice

    named = {a for arg in get_args(Voice) for a in get_args(arg) if isinstance(a, str)}
    assert {"ballad", "sage", "verse"} <= named
    client = sdk(replica.url)
    audio = {voice: client.audio.speech.create(model="tts-1", voice=voice, input="Hi.",
                                               response_format="pcm").content
             for voice in sorted(named | set(VOICES))}
    assert len(set(audio.values())) == len(audio)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="verses", input=TEXT)
    assert info.value.body["param"] == "voice" and "verse" in info.value.body["message"]


# --- HTTP/1.0 --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_http10_stream_is_close_delimited_not_500(replica, stream_format):
    status, headers, body = http10(replica.url, {"input": TEXT, "response_format": "pcm",
                                                 "stream_format": stream_format})
    assert status.startswith(b"HTTP/1.0 200"), status
    assert "transfer-encoding" not in headers and "content-length" not in headers
    if stream_format == "sse":
        events = sse_events(body.decode().split("\n\n"))
        body = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert events[-1]["type"] == "speech.audio.done"
    assert body == pcm_of(replica)


def test_http10_stream_cut_off_is_a_reset_not_a_short_success(start_replica):
    replica = start_replica("--drain-timeout", "0")  # cut off at once
    parts = urlsplit(replica.url)
    data = json.dumps({"input": "Cut me off.", "max_new_tokens": 1024, "seed": 1,
                       "response_format": "pcm"}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.0\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        assert b"200" in sock.recv(65536).split(b"\r\n")[0]
        replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                assert time.monotonic() < deadline
    assert replica.proc.wait(60) == 0
