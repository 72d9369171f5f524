"""Priority classes through a real replica: X-Omni-DP-Priority orders the queued work of the
seeded engine (its talker held by the test while the queue fills), an unknown class is a 400
naming the header, and /metrics counts and queues by class."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_dp.contract import PRIORITY_HEADER
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import plan_serve
from omni_dp.engine.server import ReplicaServer, State, bind_socket

from support.http_client import get, request
from support.speech_stream import Heard, read_until

SPEECH = "/v1/audio/speech"
# Long enough that a waiting test fails rather than hangs; never reached when it passes.
PATIENCE_S = 60.0


async def until(condition, what: str) -> None:
    async with asyncio.timeout(PATIENCE_S):
        while not condition():
            await asyncio.sleep(0.01)


def hold_the_talker(server: ReplicaServer) -> tuple[threading.Event, threading.Event]:
    """The talker's next step waits until `release` is set; `entered` says it is waiting (a
    request is running and the one slot of the batch is taken)."""
    runner = server.pipeline.local.talker.runner
    execute = runner.execute
    entered, release = threading.Event(), threading.Event()

    def held(output):
        entered.set()
        release.wait(PATIENCE_S)
        return execute(output)

    runner.execute = held
    return entered, release


async def running_server(**options) -> tuple[ReplicaServer, asyncio.Task, str]:
    server = ReplicaServer(plan_serve(ServeOptions(model="tiny", device="cpu", threads=1,
                                                   **options)))
    sock = bind_socket("127.0.0.1", 0)
    task = asyncio.create_task(server.run(sock))
    await until(lambda: server.state != State.STARTING or task.done(), "ready")
    assert server.state == State.READY, server.state
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def stop(server: ReplicaServer, task: asyncio.Task) -> None:
    server._on_signal(signal.SIGTERM)
    await asyncio.wait_for(task, 30)


def test_an_interactive_request_runs_before_the_queued_bulk_ones():
    """One slot in the running batch (--max-running-requests 1), held by a bulk request while
    two more bulk requests queue, then an interactive one: once the slot is free the
    interactive request's audio comes first, then the bulk ones in their order."""

    async def main() -> list[str]:
        server, task, url = await running_server(max_running_requests=1)
        entered, release = hold_the_talker(server)
        first_audio: list[str] = []
        try:
            async with aiohttp.ClientSession() as session:

                async def speak(name: str, priority: str) -> None:
                    body = {"input": f"Request {name}.", "max_new_tokens": 12, "seed": 1,
                            "response_format": "pcm", "stream": True}
                    async with session.post(url + SPEECH, json=body,
                                            headers={PRIORITY_HEADER: priority}) as resp:
                        assert resp.status == 200, await resp.text()
                        assert await resp.content.readany()  # its first audio
                        first_audio.append(name)
                        await resp.read()

                asks = [asyncio.create_task(speak("bulk-0", "bulk"))]
                await until(entered.is_set, "bulk-0 running")
                asks += [asyncio.create_task(speak(name, "bulk")) for name in ("bulk-1",
                                                                               "bulk-2")]
                await until(lambda: server.pipeline.num_in_flight == 3, "2 bulk queued")
                asks.append(asyncio.create_task(speak("interactive", "interactive")))
                await until(lambda: server.pipeline.num_in_flight == 4, "interactive queued")
                release.set()
                await asyncio.gather(*asks)
        finally:
            release.set()
            await stop(server, task)
        return first_audio

    order = asyncio.run(asyncio.wait_for(main(), 2 * PATIENCE_S))
    assert order == ["bulk-0", "interactive", "bulk-1", "bulk-2"]


def test_every_request_default_keeps_the_arrival_order():
    async def main() -> list[str]:
        server, task, url = await running_server(max_running_requests=1)
        entered, release = hold_the_talker(server)
        done: list[str] = []
        try:
            async with aiohttp.ClientSession() as session:

                async def speak(name: str) -> None:
                    body = {"input": f"Request {name}.", "max_new_tokens": 8,
                            "response_format": "pcm"}
                    async with session.post(url + SPEECH, json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                        done.append(name)

                asks = [asyncio.create_task(speak("r0"))]
                await until(entered.is_set, "r0 running")
                for count, name in enumerate(("r1", "r2", "r3"), start=2):
                    asks.append(asyncio.create_task(speak(name)))
                    await until(lambda c=count: server.pipeline.num_in_flight == c, name)
                release.set()
                await asyncio.gather(*asks)
        finally:
            release.set()
            await stop(server, task)
        return done

    assert asyncio.run(asyncio.wait_for(main(), 2 * PATIENCE_S)) == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("value", ["urgent", "INTERACTIVE!", "0"])
def test_an_unknown_class_is_a_400_naming_the_header(replica, value):
    status, _, body = request("POST", replica.url + SPEECH, {"input": "Hello."},
                              headers={PRIORITY_HEADER: value})
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == PRIORITY_HEADER
    assert PRIORITY_HEADER in error["message"]
    assert all(name in error["message"] for name in ("interactive", "default", "bulk"))


def test_an_unknown_class_refuses_a_speech_session_too(replica):
    async def main() -> int:
        async with aiohttp.ClientSession() as session, session.get(
                replica.url + "/v1/audio/speech/stream", headers={
                    PRIORITY_HEADER: "urgent", "Upgrade": "websocket", "Connection": "Upgrade",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}) as resp:
            assert json.loads(await resp.read())["error"]["param"] == PRIORITY_HEADER
            return resp.status

    assert asyncio.run(main()) == 400


def samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, priority label) → value, for the series that carry a priority."""
    status, _, body = get(url + "/metrics")
    assert status == 200
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if "priority" in sample.labels and "le" not in sample.labels:
                found[(sample.name, sample.labels["priority"])] = sample.value
    return found


def test_metrics_count_and_queue_by_class(replica):
    before = samples(replica.url)
    for priority in ("interactive", "bulk", None):
        headers = {PRIORITY_HEADER: priority} if priority else {}
        status, _, _ = request("POST", replica.url + SPEECH,
                               {"input": "Hi.", "max_new_tokens": 4}, headers=headers)
        assert status == 200
    after = samples(replica.url)
    for name in ("interactive", "default", "bulk"):
        key = ("omni_dp_speech_requests_by_priority_total", name)
        assert after[key] == before.get(key, 0) + 1
        assert after[("omni_dp_queue_depth", name)] == 0
        waits = ("omni_dp_queue_wait_seconds_count", name)
        assert after[waits] == before.get(waits, 0) + 1


def test_a_session_counts_under_its_class(replica):
    async def main() -> None:
        async with aiohttp.ClientSession() as session, session.ws_connect(
                replica.url + "/v1/audio/speech/stream",
                headers={PRIORITY_HEADER: "interactive"}) as ws:
            await ws.send_str(json.dumps({"type": "session.config", "response_format": "pcm",
                                          "max_new_tokens": 4}))
            await ws.send_str(json.dumps({"type": "input.text", "text": "Hi there."}))
            await ws.send_str(json.dumps({"type": "input.done"}))
            await read_until(ws, Heard(), None)

    key = ("omni_dp_speech_requests_by_priority_total", "interactive")
    before = samples(replica.url)[key]
    asyncio.run(asyncio.wait_for(main(), PATIENCE_S))
    assert samples(replica.url)[key] == before + 1
