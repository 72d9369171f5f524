"""A Piper voice behind the replica's HTTP server, run in this process (the graph loads in well
under a second; a `serve` subprocess would spend seconds importing): a multi-speaker voice's
own speaker names reach its preprocess stage through the HTTP layer, and an espeak-ng failure
fails its request alone — the replica stays up and answers the next one.

The voice: the bundled one's graph under a config that names two speakers (the graph has no
speaker input, so both sound alike; what is tested is which names get through). espeak-ng: the
real program behind a wrapper first on PATH (the phonemizer runs the program found there) that
fails, like a crashed espeak-ng, for any sentence holding BREAKS_ESPEAK.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import pytest

from omni_dp.contract import GOING_AWAY_HEADER
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import plan_serve
from omni_dp.engine.server import ReplicaServer, State, bind_socket
from omni_dp.engine.voice.model import find_voice

from support.http_client import client, is_wav
from support.recognizer import espeak_failing_on, require_voice

SPEAKERS = {"amy": 0, "bob": 1}
BREAKS_ESPEAK = "Kaboom"


@pytest.fixture(scope="module")
def two_speaker_voice(tmp_path_factory):
    """A Piper voice directory: joe's graph, its config with two named speakers."""
    require_voice()
    joe = find_voice("joe")
    directory = tmp_path_factory.mktemp("two-speakers")
    (directory / "duo.onnx").symlink_to(joe.onnx_path)
    config = json.loads(joe.config_path.read_text())
    config.update(num_speakers=len(SPEAKERS), speaker_id_map=SPEAKERS)
    (directory / "duo.onnx.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def breakable_espeak(tmp_path_factory):
    """PATH with an espeak-ng first that fails on a sentence holding BREAKS_ESPEAK."""
    require_voice()
    directory = espeak_failing_on(BREAKS_ESPEAK, tmp_path_factory.mktemp("bin"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
        yield


@contextlib.asynccontextmanager
async def served(model: str):
    """The replica's server on a free loopback port, in this process's event loop; stopped as
    SIGTERM stops it."""
    server = ReplicaServer(plan_serve(ServeOptions(model=model, device="cpu", threads=1)))
    sock = bind_socket("127.0.0.1", 0)
    running = asyncio.create_task(server.run(sock))
    try:
        for _ in range(600):  # the graph loads in a fraction of a second; 30 s at most
            if server.state != State.STARTING or running.done():
                break
            await asyncio.sleep(0.05)
        assert server.state == State.READY, f"the voice did not start: {server.state}"
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(running, 30)


async def _speak(session, url: str, **body) -> tuple[int, dict, bytes]:
    async with session.post(url + "/v1/audio/speech", json={
            "response_format": "wav", "stream": False, **body}) as response:
        return response.status, dict(response.headers), await response.read()


def test_a_multi_speaker_voice_answers_to_its_own_speaker_names_over_http(two_speaker_voice):
    """docs/voice.md: `voice` takes OpenAI's names and the voice's own speakers. The HTTP layer
    checks the name before the preprocess stage; it once knew OpenAI's names only, so a Piper
    voice's own were a 400 (commit 2c4410a)."""

    async def scenario():
        async with served(two_speaker_voice) as (_, url), client() as session:
            answers = {name: await _speak(session, url, input="Hi.", voice=name)
                       for name in ("bob", "amy", "alloy", "nobody")}
        return answers

    answers = asyncio.run(scenario())
    for name in ("bob", "amy", "alloy"):
        status, _, body = answers[name]
        assert status == 200 and is_wav(body), (name, status, body[:300])
    status, _, body = answers["nobody"]
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, "voice"), body
    assert "amy" in error["message"] and "bob" in error["message"], error  # the names it takes


def test_an_espeak_failure_fails_its_request_and_the_replica_answers_the_next(
        two_speaker_voice, breakable_espeak):
    """The phonemizer's failure is that request's: a 503 the router may retry elsewhere (with
    Retry-After), while /health stays 200 and the next request is spoken."""

    async def scenario():
        async with served(two_speaker_voice) as (server, url), client() as session:
            failed = await _speak(session, url, input=f"Hello. {BREAKS_ESPEAK} went the bomb.")
            assert server.state == State.READY, f"one request's espeak-ng failure took the " \
                f"replica down: {server.state}, {failed[2][:300]!r}"
            async with session.get(url + "/health") as response:
                health = response.status
            spoken = await _speak(session, url, input="Hello again.")
            return failed, health, spoken, server.exit_code

    failed, health, spoken, exit_code = asyncio.run(scenario())
    status, headers, body = failed
    assert status == 503 and headers.get("Retry-After") == "1", (status, body[:300])
    # the router sends it to another replica; the header says the replica's true state
    assert headers.get(GOING_AWAY_HEADER) == "ready", headers
    assert "phonemizer failed" in json.loads(body)["error"]["message"], body
    assert health == 200
    assert spoken[0] == 200 and is_wav(spoken[2]), spoken[:2]
    assert exit_code == 0  # stopped by the test's SIGTERM, not failed
