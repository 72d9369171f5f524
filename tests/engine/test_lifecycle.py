"""Replica lifecycle over real processes: drain on SIGTERM, client disconnects, engine state."""

from __future__ import annotations

import asyncio
import signal
import threading

import aiohttp
import pytest

from support.http_client import get, post_json
from support.wait import wait_for

SPEECH = "/v1/audio/speech"
WAIT_S, POLL_S = 30, 0.02


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_request_then_exits_0(start_replica, sig):
    replica = start_replica()
    long_body = {"input": "Finish me.", "max_new_tokens": 500, "seed": 3, "response_format": "pcm"}
    expected = post_json(replica.url + SPEECH, long_body)[2]  # its full output, served alone

    result = {}
    worker = threading.Thread(
        target=lambda: result.update(response=post_json(replica.url + SPEECH, long_body))
    )
    worker.start()
    wait_for("request running", lambda: replica.metric("omni_dp_requests_running") == 1,
             WAIT_S, POLL_S)
    replica.proc.send_signal(sig)

    wait_for("health 503 while draining", lambda: get(replica.url + "/health")[0] == 503,
             WAIT_S, POLL_S)
    status, headers, body = post_json(replica.url + SPEECH, {"input": "Too late."})
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert headers["X-Omni-DP-Going-Away"] == "draining"  # a router sends it elsewhere
    assert b"draining" in body

    worker.join(120)
    status, _, body = result["response"]
    assert status == 200
    assert body == expected  # finished in full, not cut off
    assert replica.proc.wait(60) == 0
    assert f"{sig.name}: draining" in replica.log_text()


@pytest.mark.parametrize(
    ("flags", "signals", "log_line"),
    [
        (["--drain-timeout", "0.5"], [signal.SIGTERM], "drain timeout"),
        ([], [signal.SIGTERM, signal.SIGTERM], "again: stopping without waiting"),
    ],
    ids=["drain-timeout", "second-signal"],
)
def test_draining_is_bounded(start_replica, flags, signals, log_line):
    replica = start_replica(*flags)
    body = {"input": "Never finishes in time.", "max_new_tokens": 1024, "stream": True}

    async def hold_stream():
        async with aiohttp.ClientSession() as session, \
                session.post(replica.url + SPEECH, json=body) as resp:
            await resp.content.readany()  # the stream has started
            for sig in signals:
                replica.proc.send_signal(sig)
                await asyncio.sleep(0.1)
            try:
                await resp.read()
            except aiohttp.ClientPayloadError:
                return "cut"
            return "complete"

    assert asyncio.run(hold_stream()) == "cut"  # a truncated stream is an error, not a success
    assert replica.proc.wait(60) == 0
    assert log_line in replica.log_text()


def test_client_disconnect_frees_pages_at_once(start_replica):
    replica = start_replica()
    body = {"input": "Hang up on me.", "max_new_tokens": 1024, "seed": 1}
    before = replica.metric("omni_dp_generated_tokens_total")
    assert post_json(replica.url + SPEECH, body)[0] == 200  # the same request, to its end
    full = replica.metric("omni_dp_generated_tokens_total") - before
    before += full

    async def disconnect_mid_stream():
        async with aiohttp.ClientSession() as session, \
                session.post(replica.url + SPEECH, json={**body, "stream": True}) as resp:
            await resp.content.readany()  # may be only the WAV header, sent before admission
            wait_for("pages held", lambda: replica.metric("omni_dp_kv_pages_used") > 0,
                     WAIT_S, POLL_S)
        # leaving the block closes the connection with the response unread

    asyncio.run(disconnect_mid_stream())
    wait_for("pages freed", lambda: replica.metric("omni_dp_kv_pages_used") == 0, WAIT_S, POLL_S)
    assert replica.metric("omni_dp_requests_running") == 0
    generated = replica.metric("omni_dp_generated_tokens_total") - before
    assert 0 < generated < full  # stopped early, not run to completion (same seed, same tokens)
    disconnected = 'omni_dp_speech_requests_total{outcome="client_disconnected"}'
    wait_for("disconnect counted", lambda: replica.metric(disconnected, default=0) == 1,
             WAIT_S, POLL_S)
    assert get(replica.url + "/health")[0] == 200


def test_non_streamed_client_disconnect_also_aborts(start_replica):
    replica = start_replica()

    async def give_up():
        body = {"input": "Hang up before the answer.", "max_new_tokens": 1024, "seed": 2,
                "stream": False}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            try:
                async with session.post(replica.url + SPEECH, json=body) as resp:
                    await resp.read()
            except TimeoutError:
                return
        raise AssertionError("the request finished before the client gave up")

    asyncio.run(give_up())
    wait_for("pages freed", lambda: replica.metric("omni_dp_kv_pages_used") == 0, WAIT_S, POLL_S)
    assert replica.metric("omni_dp_generated_tokens_total") < 1024


def test_health_is_503_until_weights_and_pool_are_ready(start_replica):
    # `small` takes a while to initialise its ~80M parameters: /health must say so meanwhile.
    replica = start_replica("--model", "small", "--max-total-tokens", "1024", ready=False)
    replica.wait_listening()
    status, _, body = get(replica.url + "/health")
    assert (status, body) == (503, b'{"status": "starting"}')
    assert get(replica.url + "/get_server_info")[0] == 503
    assert post_json(replica.url + SPEECH, {"input": "Too early."})[0] == 503
    replica.wait_ready()
    assert replica.info()["max_total_num_tokens"] == 1024
