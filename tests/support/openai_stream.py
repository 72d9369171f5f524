"""A streamed OpenAI-style answer (completions or chat SSE) as the client read it: its chunks,
its [DONE] lines and error events, and whether the body ended without its terminating chunk."""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp


@dataclass
class Read:
    """A streamed LLM answer as the client read it."""

    status: int
    chunks: list[dict]
    dones: int
    errors: list[dict]
    broken: bool  # the body ended without its terminating chunk

    @property
    def text(self) -> str:
        out = ""
        for chunk in self.chunks:
            for choice in chunk.get("choices") or ():
                out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        return out

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for ch in c.get("choices") or ()
                for t in ch.get("token_ids") or ()]

    @property
    def usage(self) -> dict | None:
        usages = [c["usage"] for c in self.chunks if c.get("usage")]
        assert len(usages) <= 1, usages
        return usages[0] if usages else None

    @property
    def finish(self) -> list[str]:
        return [ch["finish_reason"] for c in self.chunks for ch in c.get("choices") or ()
                if ch.get("finish_reason")]


def parse_sse(body: bytes, status: int = 200, broken: bool = False) -> Read:
    chunks, dones, errors = [], 0, []
    for block in body.decode().split("\n\n"):
        if not block.startswith("data: "):
            assert not block.strip(), block
            continue
        payload = block[len("data: "):]
        if payload == "[DONE]":
            dones += 1
            continue
        parsed = json.loads(payload)
        (errors if "error" in parsed else chunks).append(parsed)
    return Read(status, chunks, dones, errors, broken)


async def post_stream(session: aiohttp.ClientSession, url: str, body, *, on_chunk=None,
                      request_id: str = "r") -> tuple[Read, dict]:
    """POST `body` (JSON, or bytes as they are) and read the SSE answer whole; `on_chunk` is
    called with each count of data lines read so far. (what was read, the answer's headers)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=raw, headers={"Content-Type": "application/json",
                                                      "X-Request-ID": request_id}) as resp:
        got, broken = b"", False
        try:
            async for chunk in resp.content.iter_any():
                got += chunk
                if on_chunk is not None:
                    on_chunk(got.count(b"data: "))
        except aiohttp.ClientPayloadError:
            broken = True
        return parse_sse(got, resp.status, broken), dict(resp.headers)
