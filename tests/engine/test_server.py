"""The replica over real HTTP: formats, streaming, determinism, KV sizing, load, bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave

import aiohttp
import pytest

from omni_dp.engine.config import PRESETS

from support.http_client import get, post_json, request

SPEECH = "/v1/audio/speech"
TINY = PRESETS["tiny"]


def speak(replica, **body) -> tuple[int, dict, bytes]:
    body.setdefault("input", "Omni pipelines, one GPU.")
    return post_json(replica.url + SPEECH, body)


def parse_wav(data: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return wav.getframerate(), wav.readframes(wav.getnframes())


def sse_events(body: bytes) -> list[dict]:
    events = []
    for block in body.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: "):]))
    return events


# --- formats and streaming -----------------------------------------------------------------


def test_wav_response_is_a_valid_24khz_file(replica):
    status, headers, body = speak(replica, stream=False)  # buffered: the header's sizes exact
    assert status == 200, body
    assert headers["Content-Type"] == "audio/wav"
    assert int(headers["Content-Length"]) == len(body)
    rate, frames = parse_wav(body)
    assert rate == TINY.sample_rate == int(headers["X-Sample-Rate"])
    assert len(frames) > 0
    assert len(frames) == len(body) - 44  # the header's data size is exact
    assert len(frames) % (2 * TINY.vocoder.samples_per_token) == 0  # whole codec frames


def test_every_format_and_stream_mode_carries_the_same_samples(replica):
    _, _, pcm = speak(replica, response_format="pcm", stream=False)
    _, _, wav = speak(replica, response_format="wav", stream=False)
    assert parse_wav(wav)[1] == pcm

    _, headers, streamed_pcm = speak(replica, response_format="pcm", stream=True)
    assert headers.get("Transfer-Encoding") == "chunked"
    assert streamed_pcm == pcm

    _, _, streamed_wav = speak(replica, response_format="wav", stream=True)
    assert struct.unpack("<I", streamed_wav[40:44])[0] == 0xFFFFFFFF  # length unknown up front
    assert streamed_wav[44:] == pcm

    for fmt, payload in (("pcm", pcm), ("wav", streamed_wav)):
        _, headers, body = speak(replica, response_format=fmt, stream=True, stream_format="sse")
        assert headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(body)
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == payload
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["audio_seconds"] == pytest.approx(len(pcm) / 2 / 24000)


def test_stream_sends_audio_before_the_request_finishes(replica):
    async def run() -> tuple[int, float, float]:
        loop = asyncio.get_running_loop()
        body = {"input": "A longer sentence, so that there are many chunks to send.",
                "stream": True, "stream_format": "sse", "max_new_tokens": 300, "seed": 7}
        times = []
        async with aiohttp.ClientSession() as session, \
                session.post(replica.url + SPEECH, json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    times.append((json.loads(line[6:])["type"], loop.time()))
        deltas = [t for kind, t in times if kind == "speech.audio.delta"]
        done = [t for kind, t in times if kind == "speech.audio.done"]
        return len(deltas), deltas[0], done[0]

    num_deltas, first, done = asyncio.run(run())
    assert num_deltas > 3
    assert first < done


# --- determinism ---------------------------------------------------------------------------


def test_same_request_same_bytes_across_processes(replica, start_replica):
    other = start_replica()
    assert other.pid != replica.pid
    for body in ({"input": "Same weights, same audio."},
                 {"input": "Seeded.", "seed": 12345, "voice": "onyx"}):
        first = speak(replica, **body)
        second = speak(other, **body)
        assert first[0] == second[0] == 200
        assert first[2] == second[2]


def test_seed_changes_audio_and_x_seed_reproduces_it(replica):
    _, headers, default = speak(replica, input="Reproduce me.")
    _, _, replay = speak(replica, input="Reproduce me.", seed=int(headers["X-Seed"]))
    _, _, other = speak(replica, input="Reproduce me.", seed=int(headers["X-Seed"]) + 1)
    assert replay == default
    assert other != default


def test_voice_changes_audio(replica):
    assert speak(replica, voice="alloy", seed=1)[2] != speak(replica, voice="echo", seed=1)[2]


# --- KV sizing -----------------------------------------------------------------------------


def tiny_bytes_per_token(dtype_size: int) -> int:
    return 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * dtype_size


def test_kv_pool_sized_by_tokens(start_replica):
    info = start_replica("--max-total-tokens", "4096", "--page-size", "32").info()
    per_token = tiny_bytes_per_token(8)  # float64 on CPU
    assert info["kv_bytes_per_token"] == per_token
    assert info["max_total_num_tokens"] == 4096
    assert info["kv_cache_bytes"] == 4096 * per_token
    assert info["num_pages"] == 4096 // 32


def test_kv_pool_sized_by_bytes(start_replica):
    budget = 3 * 1024**2 + 12345
    replica = start_replica("--kv-cache-bytes", str(budget), "--dtype", "float32")
    info = replica.info()
    per_token = tiny_bytes_per_token(4)
    pages = budget // (16 * per_token)
    assert info["kv_bytes_per_token"] == per_token
    assert info["num_pages"] == pages
    assert info["max_total_num_tokens"] == pages * 16
    assert info["kv_cache_bytes"] == pages * 16 * per_token <= budget
    assert replica.metric("omni_dp_kv_pages_capacity") == pages


def test_server_info_lists_every_process(replica):
    info = replica.info()
    assert info["processes"] == [
        {"pid": replica.pid, "role": "main", "device": "cpu",
         "stages": ["preprocess", "talker", "vocoder"], "threads": 1}
    ]
    assert info["device"] == "cpu"
    assert info["max_running_requests"] == 32
    status, _, body = get(replica.url + "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == "omni-dp-tiny"


# --- load: queueing and preemption ---------------------------------------------------------


async def speak_many(url: str, bodies: list[dict]) -> list[tuple[int, bytes]]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(body):
            async with session.post(url + SPEECH, json=body) as resp:
                return resp.status, await resp.read()

        return await asyncio.gather(*(one(b) for b in bodies))


def test_small_pool_queues_and_preempts_without_changing_any_output(start_replica):
    # 16 pages of 16 tokens. Each request needs ~7 pages at its longest: alone it fits, but
    # eight at once must queue and preempt.
    replica = start_replica("--max-total-tokens", "256", "--max-running-requests", "8")
    bodies = [{"input": f"Request number {i}.", "seed": i, "max_new_tokens": 90,
               "response_format": "pcm", "stream": i % 2 == 0} for i in range(8)]
    alone = [speak(replica, **body) for body in bodies]
    assert all(status == 200 for status, _, _ in alone)
    assert replica.metric("omni_dp_preemptions_total") == 0

    together = asyncio.run(speak_many(replica.url, bodies))

    assert replica.metric("omni_dp_preemptions_total") > 0
    for (status, body), (_, _, expected) in zip(together, alone, strict=True):
        assert status == 200
        assert body == expected
    assert replica.metric("omni_dp_kv_pages_used") == 0


def test_request_that_can_never_fit_the_pool_is_refused(start_replica):
    replica = start_replica("--max-total-tokens", "64")
    status, _, body = speak(replica, input="Too long for a 64-token pool.", max_new_tokens=60)
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == "input"
    assert "64" in error["message"]
    assert speak(replica, input="Short.", max_new_tokens=20)[0] == 200


def test_full_replica_answers_503_with_retry_after(start_replica):
    replica = start_replica("--max-running-requests", "1", "--max-queued-requests", "0")

    async def run():
        async with aiohttp.ClientSession() as session:
            async def one(seed):
                body = {"input": "Busy.", "max_new_tokens": 400, "seed": seed}
                async with session.post(replica.url + SPEECH, json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.read()

            return await asyncio.gather(*(one(seed) for seed in range(3)))

    results = asyncio.run(run())
    assert sorted(status for status, _, _ in results)[0] == 200
    rejected = [(retry, body) for status, retry, body in results if status == 503]
    assert rejected
    for retry_after, body in rejected:
        assert retry_after == "1"
        assert "full" in json.loads(body)["error"]["message"]


# --- bad input -----------------------------------------------------------------------------

BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"voice": "alloy"}, 400, "input"),
    ({"input": 42}, 400, "input"),
    ({"input": "   \n\t "}, 400, "input"),
    ({"input": "x" * 4097}, 400, "input"),  # OpenAI's bound, the default --max-input-chars
    ({"input": "hi", "voice": "darth"}, 400, "voice"),
    ({"input": "hi", "response_format": "m4a"}, 400, "response_format"),
    ({"input": "hi", "stream_format": "websocket"}, 400, "stream_format"),
    ({"input": "hi", "stream": "yes"}, 400, "stream"),
    ({"input": "hi", "seed": -1}, 400, "seed"),
    ({"input": "hi", "seed": 1.5}, 400, "seed"),
    ({"input": "hi", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ({"input": "hi", "max_new_tokens": 100000}, 400, "max_new_tokens"),
    ({"input": "hi", "speed": 5}, 400, "speed"),
    ({"input": "hi", "stream": False, "stream_format": "sse"}, 400, "stream"),
    (json.dumps({"input": "y" * 70000}).encode(), 413, None),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_REQUESTS)
def test_bad_input_gets_a_clear_4xx(replica, body, status, field):
    got, headers, raw = post_json(replica.url + SPEECH, body)
    assert got == status, raw
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert error["param"] == field
    assert error["message"]
    assert get(replica.url + "/health")[0] == 200


def test_bad_requests_are_counted_and_leave_no_state(replica):
    before = replica.metric('omni_dp_speech_requests_total{outcome="bad_request"}', default=0)
    post_json(replica.url + SPEECH, {"input": ""})
    after = replica.metric('omni_dp_speech_requests_total{outcome="bad_request"}')
    assert after == before + 1
    assert replica.metric("omni_dp_requests_waiting") == 0


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/audio/speech", 405), ("POST", "/v1/audio/nonsense", 404)],
)
def test_unknown_routes_get_json_errors(replica, method, path, status):
    got, headers, body = request(method, replica.url + path, b"{}")
    assert got == status
    assert headers["Content-Type"].startswith("application/json")
    assert path in json.loads(body)["error"]["message"]
