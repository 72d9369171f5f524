"""The replica's side of the router's resume (docs/contracts.md, "Retry and resume"): an answer
asked from a byte on is the whole answer's bytes from that byte; the router's seed is used
when the body names none; what cannot be resumed is refused by name."""

from __future__ import annotations

import base64
import json

import pytest

from support.http_client import post_json, request

SPEECH = "/v1/audio/speech"
BODY = {"input": "Resume me from any byte.", "max_new_tokens": 40, "response_format": "pcm"}


def speak(replica, headers: dict | None = None, **fields) -> tuple[int, dict, bytes]:
    return request("POST", replica.url + SPEECH, {**BODY, **fields}, headers=headers)


def sse_audio(body: bytes) -> tuple[bytes, list[dict]]:
    events = [json.loads(block[len("data: "):]) for block in body.decode().split("\n\n")
              if block.strip()]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events
                     if e["type"] == "speech.audio.delta")
    return audio, events


@pytest.mark.parametrize("fields", [
    {"response_format": "pcm"},
    {"response_format": "wav"},
    {"response_format": "pcm", "stream": False},
    {"response_format": "wav", "stream": False},
], ids=["pcm", "wav", "pcm-whole", "wav-whole"])
def test_an_answer_resumed_from_a_byte_is_the_whole_answer_from_that_byte(replica, fields):
    status, headers, whole = speak(replica, **fields)
    assert status == 200
    assert headers["X-Omni-DP-Resumable"] == "bytes"
    assert "X-Omni-DP-Resumed-From" not in headers
    for offset in (0, 1, 44, 4097, len(whole) - 1, len(whole)):
        status, got_headers, rest = speak(replica, {"X-Omni-DP-Resume-From": str(offset)},
                                          **fields)
        assert status == 200
        assert got_headers["X-Omni-DP-Resumed-From"] == str(offset)
        assert got_headers["X-Seed"] == headers["X-Seed"]
        assert rest == whole[offset:], offset


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_sse_resumed_from_an_audio_byte_is_one_well_formed_stream(replica, fmt):
    status, _, whole = speak(replica, response_format=fmt, stream_format="sse")
    assert status == 200
    audio, events = sse_audio(whole)
    for offset in (1, 1000, len(audio) - 3):
        status, headers, body = speak(replica, {"X-Omni-DP-Resume-From": str(offset)},
                                      response_format=fmt, stream_format="sse")
        assert status == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        rest, rest_events = sse_audio(body)
        assert audio[:offset] + rest == audio
        assert {e["type"] for e in rest_events[:-1]} == {"speech.audio.delta"}
        assert rest_events[-1] == events[-1]  # the same done event, usage of the whole answer


def test_the_routers_seed_is_used_when_the_body_names_none(replica):
    _, headers, default = speak(replica)
    other_seed = str(int(headers["X-Seed"]) + 1)
    _, seeded_headers, seeded = speak(replica, {"X-Omni-DP-Seed": other_seed})
    assert seeded_headers["X-Seed"] == other_seed
    assert seeded != default
    assert speak(replica, seed=int(other_seed))[2] == seeded
    # the body's own seed wins over the header
    _, body_headers, body_seeded = speak(replica, {"X-Omni-DP-Seed": other_seed},
                                         seed=int(headers["X-Seed"]))
    assert body_headers["X-Seed"] == headers["X-Seed"]
    assert body_seeded == default


@pytest.mark.parametrize(("headers", "fields", "param"), [
    ({"X-Omni-DP-Resume-From": "-1"}, {}, "X-Omni-DP-Resume-From"),
    ({"X-Omni-DP-Resume-From": "1e3"}, {}, "X-Omni-DP-Resume-From"),
    ({"X-Omni-DP-Resume-From": "10"}, {"response_format": "opus"}, "X-Omni-DP-Resume-From"),
    ({"X-Omni-DP-Resume-From": "10"}, {"response_format": "flac"}, "X-Omni-DP-Resume-From"),
    ({"X-Omni-DP-Seed": "x"}, {}, "X-Omni-DP-Seed"),
    ({"X-Omni-DP-Seed": str(2**63)}, {}, "X-Omni-DP-Seed"),
])
def test_a_resume_that_cannot_be_served_is_a_400_naming_the_header(replica, headers, fields,
                                                                    param):
    status, _, body = speak(replica, headers, **fields)
    assert status == 400, body
    assert json.loads(body)["error"]["param"] == param


@pytest.mark.parametrize("fmt", ["opus", "flac", "mp3", "aac"])
def test_compressed_answers_do_not_say_they_are_resumable(replica, fmt):
    status, headers, _ = post_json(replica.url + SPEECH, {**BODY, "response_format": fmt})
    assert status == 200
    assert "X-Omni-DP-Resumable" not in headers


def test_a_replica_whose_samples_batching_can_change_does_not_offer_resume(start_replica):
    """float32 (like CUDA's bfloat16): a batch can flip a sample, so another replica might
    not regenerate the same answer; it still honours an offset it is asked for."""
    replica = start_replica("--dtype", "float32")
    status, headers, whole = speak(replica)
    assert status == 200
    assert "X-Omni-DP-Resumable" not in headers
    _, _, rest = speak(replica, {"X-Omni-DP-Resume-From": "100"})
    assert rest == whole[100:]
