"""TEST STAND-IN for the load generator's tests (tests/bench/test_load.py): a tiny aiohttp
server on loopback that answers /v1/audio/speech and /v1/completions as the request's text
tells it to. Not an omni-dp engine and not a router: only enough to give the bench each outcome
it must count.

    "ok"    streamed PCM: CHUNKS chunks of CHUNK_BYTES, `delay_s` apart (X-Sample-Rate, and the
            router's X-Omni-DP-Replica naming `replica`); with `stream: false` one WAV
    "busy"  503 with Retry-After, as the router's admission answers
    "hang"  headers never come (until the client gives up)
    "drop"  a first chunk of audio, then the connection closed mid-stream (no terminator)
    "reset" the connection closed before any answer

/v1/completions streams SSE text events, a usage event (`usage.completion_tokens` = TOKENS)
and `data: [DONE]`; "error" ends the stream with an error event instead, as vLLM does.
Runs in the caller's event loop: `async with BenchStandin() as standin:`.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time

from aiohttp import web

from support.ports import LOOPBACK

SAMPLE_RATE = 16000
CHUNK_BYTES = 3200  # 0.1 s of 16-bit mono at 16 kHz
CHUNKS = 3
TOKENS = 7


def wav(pcm: bytes, rate: int = SAMPLE_RATE) -> bytes:
    return (b"RIFF" + struct.pack("<I", 36 + len(pcm)) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", len(pcm)) + pcm)


class BenchStandin:
    """The stand-in server; `hits` holds (monotonic time, text) of every request received."""

    def __init__(self, *, delay_s: float = 0.01, replica: str = "r7") -> None:
        self.delay_s = delay_s
        self.replica = replica
        self.hits: list[tuple[float, str]] = []
        self.port = 0
        app = web.Application()
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_post("/v1/completions", self._completions)
        # handler_cancellation: a "hang" handler ends when the bench gives up on it.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    async def __aenter__(self) -> BenchStandin:
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["input"]
        self.hits.append((time.monotonic(), text))
        headers = {"X-Sample-Rate": str(SAMPLE_RATE), "X-Omni-DP-Replica": self.replica}
        if text == "busy":
            return web.json_response({"error": {"message": "at capacity"}}, status=503,
                                     headers={"Retry-After": "1"})
        if text == "hang":
            await asyncio.sleep(3600)
        if text == "reset":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if text == "silence":  # a 200 without audio: an untrained model may stop at once
            return web.Response(body=b"", content_type="audio/pcm", headers=headers)
        if not body.get("stream", True):
            await asyncio.sleep(self.delay_s)
            return web.Response(body=wav(bytes(CHUNK_BYTES * CHUNKS)),
                                content_type="audio/wav", headers=headers)
        response = web.StreamResponse(headers={**headers, "Content-Type": "audio/pcm"})
        await response.prepare(request)
        for _ in range(CHUNKS):
            await asyncio.sleep(self.delay_s)
            await response.write(bytes(CHUNK_BYTES))
            if text == "drop":
                assert request.transport is not None
                request.transport.close()  # cut: the chunked body never ends
                return response
        await response.write_eof()
        return response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.hits.append((time.monotonic(), body["prompt"]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Omni-DP-Replica": self.replica})
        await response.prepare(request)

        async def event(payload: object) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        for i in range(3):
            await asyncio.sleep(self.delay_s)
            await event({"choices": [{"index": 0, "text": f" t{i}"}], "usage": None})
        if body["prompt"] == "error":
            await event({"error": {"message": "engine died", "code": 500}})
        else:
            await event({"choices": [], "usage": {"prompt_tokens": 3,
                                                  "completion_tokens": TOKENS}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
