"""A client of the WebSocket speech session (GET /v1/audio/speech/stream) for the tests: it
reads the session's messages as docs/contracts.md tells a client to, a sentence marked
`resent` replacing the audio it had of that sentence."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp


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
