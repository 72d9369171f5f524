"""A client of the WebSocket speech session (GET /v1/audio/speech/stream) for the tests: it
reads the session's messages as docs/contracts.md tells a client to, a sentence marked
`resent` replacing the audio it had of that sentence. And a stand-in replica: the real session
code (engine/speech_stream.py) in this process over a pipeline the test holds and fails, for
the timeouts, the bounds and the router's moves."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from omni_dp.engine.api import parse_speech_body
from omni_dp.engine.pipeline import EngineFailed
from omni_dp.engine.server import ReplicaServer
from omni_dp.engine.speech_stream import SpeechStreams
from omni_dp.speech_stream import SPEECH_STREAM_PATH

from support.ports import LOOPBACK


@dataclass
class Heard:
    """What a client got from one session."""

    events: list[dict] = field(default_factory=list)  # the JSON messages, in order
    audio: dict[int, bytearray] = field(default_factory=dict)  # each sentence's, as replaced
    close_code: int | None = None
    _open: int | None = None  # the sentence whose audio frames arrive now

    def take(self, msg: aiohttp.WSMessage) -> dict | None:
        """One message; the JSON of a text one."""
        if msg.type == aiohttp.WSMsgType.BINARY:
            assert self._open is not None, "audio outside audio.start/audio.done"
            self.audio[self._open] += msg.data
            return None
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        event = json.loads(msg.data)
        self.events.append(event)
        if event["type"] == "audio.start":
            self._open = event["sentence_index"]
            # A resent sentence: the audio had of it so far is dropped (the contract's rule).
            self.audio[self._open] = bytearray()
        elif event["type"] == "audio.done":
            assert event["sentence_index"] == self._open, event
            self._open = None
        return event

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def sentences(self) -> list[dict]:
        """The audio.start of each sentence as the client keeps it: a resent one replaces the
        one of its index before it."""
        kept: dict[int, dict] = {}
        for event in self.of("audio.start"):
            index = event["sentence_index"]
            assert event.get("resent", False) == (index in kept), (
                f"sentence {index} started again without `resent`, or `resent` on a first "
                f"start: {event}")
            kept[index] = event
        return [kept[i] for i in sorted(kept)]


async def read_until(ws: aiohttp.ClientWebSocketResponse, heard: Heard, kind: str | None,
                     timeout: float = 30.0) -> dict | None:
    """Read until a message of `kind` (returned) or, with None, until the close."""
    async with asyncio.timeout(timeout):
        while True:
            msg = await ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
                heard.close_code = ws.close_code
                assert kind is None, f"closed ({ws.close_code}) before a {kind}: {heard.events}"
                return None
            event = heard.take(msg)
            if event is not None and event["type"] == kind:
                return event


def pieces(text: str, size: int) -> list[str]:
    """`text` cut every `size` characters, as an LLM's tokens arrive (mid-word included)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


async def send_text(ws: aiohttp.ClientWebSocketResponse, text: str) -> None:
    await ws.send_str(json.dumps({"type": "input.text", "text": text}))


async def send_done(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str(json.dumps({"type": "input.done"}))


class StandInPipeline:
    """prepare: the text; synthesize: a chunk of PCM (`chunk_bytes`), then (once `gate` is
    set; it is at first) a second, or EngineFailed if `fail` (the replica's close 1011: a
    movable one)."""

    def __init__(self, chunk_bytes: int = 64) -> None:
        self.chunk_bytes = chunk_bytes
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False
        self.num_in_flight = 0
        self.started = asyncio.Event()  # a sentence's first chunk is out
        self.asks: list = []  # every SpeechAsk prepared, in order

    async def prepare(self, ask):
        self.asks.append(ask)
        return ask.input

    async def synthesize(self, text: str, priority=None):
        self.num_in_flight += 1
        try:
            yield b"\x01\x00" * (self.chunk_bytes // 2)
            self.started.set()
            await self.gate.wait()
            if self.fail:
                raise EngineFailed("the stand-in's engine failed")
            yield b"\x02\x00" * (self.chunk_bytes // 2)
        finally:
            self.num_in_flight -= 1


class StandInReplica:
    """SpeechStreams on 127.0.0.1:0 over a StandInPipeline, with the given timeouts and
    --max-input-chars. `handshake` (set at first) holds an upgrade until set; `arrived` is
    set by each one; `sessions` counts the handlers running."""

    def __init__(self, *, max_input_chars: int = 4096, config_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, chunk_bytes: int = 64) -> None:
        self.pipeline = StandInPipeline(chunk_bytes)
        # the replica's own admission and body check, as a ready replica with room answers
        server = SimpleNamespace(
            pipeline=self.pipeline, options=SimpleNamespace(max_input_chars=max_input_chars),
            plan=SimpleNamespace(sample_rate=24000), not_ready=lambda: None,
            full=lambda: None, refused=ReplicaServer.refused,
            priority_of=ReplicaServer.priority_of,
            metrics=SimpleNamespace(count_priority=lambda priority: None),
            speech_params=lambda raw: parse_speech_body(raw, max_new_tokens_limit=2**31 - 1))
        self.streams = SpeechStreams(server, config_timeout_s=config_timeout_s,
                                     idle_timeout_s=idle_timeout_s)
        self.handshake = asyncio.Event()
        self.handshake.set()
        self.arrived = asyncio.Event()
        self.sessions = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.arrived.set()
        await self.handshake.wait()
        self.sessions += 1
        try:
            return await self.streams.handle(request)
        finally:
            self.sessions -= 1

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def __aenter__(self) -> StandInReplica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get(SPEECH_STREAM_PATH, self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, 0).start()
        self.url = f"http://{LOOPBACK}:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def idle(self) -> bool:
        return self.sessions == 0 and self.pipeline.num_in_flight == 0
