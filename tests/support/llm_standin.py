"""A stand-in LLM replica for the router's migration tests: vLLM 0.32's streamed completions
and chat chunks (their shapes as recorded from the real server; tests/launcher/
test_engine_vllm_live.py runs the real one) over a toy model.

The toy model's next token is a function of every token before it (greedy), so a continuation
from the prompt's ids plus the generated ones goes on exactly as the uncut request; sampled
(temperature > 0) it draws from a seeded generator, as an engine does, so a continuation goes
another way. Its detokenizer is vLLM's in miniature: a "pending" token (a multiple of 7: the
first byte of a character) writes nothing until the next token, which then writes "é" first;
a prompt that ends in a pending token makes the first text written the whole prompt's
(`PROMPT_DUMP`), as tokenizers' DecodeStream does after a prefill that ends mid-character.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

from aiohttp import web

from support.router import Backend, Seen

MODEL = "toy-llm"
MAX_MODEL_LEN = 512
PROMPT_DUMP = "<the whole prompt's text>"


def next_token(sequence: list[int]) -> int:
    """The greedy next token: a function of the whole sequence."""
    return (sum(sequence) * 31 + len(sequence) * 17 + sequence[-1] * 7) % 60 + 4


def pending(token: int) -> bool:
    return token % 7 == 0


def piece(token: int) -> str:
    return chr(ord("a") + token % 26)


def prompt_ids(request: dict, chat: bool) -> list[int]:
    if chat:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in request["messages"]) + "a:"
    else:
        text = request["prompt"]
        if isinstance(text, list) and all(isinstance(t, int) for t in text):
            return list(text)
        if isinstance(text, list):  # several prompts: this toy answers the first
            text = text[0]
    return [1] + [ord(c) % 50 + 10 for c in text]


@dataclass
class Detokenizer:
    """What each token writes, given the prompt it was primed with."""

    dump_first: bool  # the prompt ended mid-character: the first text is the prompt's
    waiting: int = 0

    def step(self, token: int) -> str:
        if pending(token):
            self.waiting += 1
            return ""
        text = "é" * self.waiting + piece(token)
        self.waiting = 0
        if self.dump_first:
            self.dump_first = False
            return PROMPT_DUMP + text
        return text


@dataclass
class Failure:
    """How the replica fails after `after` generated tokens (None: it does not).

    `how="after_done"` needs no `after`: the replica sends its whole answer, [DONE] included,
    and is killed before the chunked body's terminating chunk, once `backend.release` is set
    (the test sets it when its client has read the [DONE], so that the router relayed it)."""

    after: int | None = None
    how: str = "kill"  # kill | error_event | abort | close | stall | after_done


def standin(failure: Failure | None = None, *, per_chunk: int = 1, pace_s: float = 0.001,
            honours_token_ids: bool = True, created: int = 1_800_000_000,
            whole: bool = False):
    """A Backend handler: streams the toy model's answer in vLLM's chunks, `per_chunk` tokens
    to a chunk (vLLM merges them when its reader lags), failing as `failure` says; `whole`:
    every chunk in one body of known length instead."""
    failure = failure or Failure()

    async def handler(backend: Backend, request: web.Request, seen: Seen) -> web.StreamResponse:
        body = json.loads(seen.body)
        chat = request.path.endswith("/chat/completions")
        stream = _Stream(backend, body, chat, honours_token_ids, created)
        if whole:
            events = b"".join(event for event, _ in stream.events(per_chunk))
            return web.Response(body=events, content_type="text/event-stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event, made in stream.events(per_chunk):
            if failure.after is not None and made >= failure.after:
                await _fail(request, response, stream, failure.how)
                return response
            await response.write(event)
            await asyncio.sleep(pace_s)
        if failure.how == "after_done":
            await backend.release.wait()
            request.transport.abort()  # killed before the terminating chunk
            return response
        await response.write_eof()
        return response

    return handler


async def _fail(request: web.Request, response: web.StreamResponse, stream: _Stream,
                how: str) -> None:
    if how == "error_event":
        await response.write(b'data: {"error": {"object": "error", "message": "EngineCore '
                             b'died", "type": "InternalServerError", "code": 500}}\n\n')
    elif how == "abort":
        await response.write(stream.chunk([], "", "abort"))
    elif how == "stall":
        await asyncio.sleep(3600)
    if how == "close":
        await response.write_eof()  # a clean end, before the finish and [DONE]
        return
    await asyncio.sleep(0.01)
    request.transport.abort()  # as a kill -9 leaves it


class _Stream:
    """One answer: the toy model's tokens as vLLM 0.32 chunks them."""

    def __init__(self, backend: Backend, body: dict, chat: bool, honours_ids: bool,
                 created: int) -> None:
        self.body, self.chat = body, chat
        self.ids = bool(body.get("return_token_ids")) and honours_ids
        self.prompt = prompt_ids(body, chat)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{backend.name}-{len(backend.seen)}"
        self.created = created + len(backend.seen)
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or \
            (MAX_MODEL_LEN - len(self.prompt) if chat else 16)
        temperature = body.get("temperature", 1.0)
        self.rng = random.Random(body.get("seed")) if temperature else None
        self.detok = Detokenizer(dump_first=bool(self.prompt) and pending(self.prompt[-1]))
        self.first = True

    def head(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.body.get("model", MODEL)}

    def chunk(self, tokens: list[int], text: str, finish: str | None) -> bytes:
        ids = tokens if self.ids else None
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None,
                      "prompt_token_ids": self.prompt if self.ids and self.first else None,
                      "token_ids": ids}
        self.first = False
        chunk = {**self.head(), "choices": [choice]}
        if finish is not None and not self.include_usage:
            chunk["system_fingerprint"] = "toy-0.32"
        return _sse(chunk)

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def events(self, per_chunk: int):
        """(event bytes, tokens generated before it) for the whole answer."""
        if self.chat:
            first = {**self.head(), "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": self.prompt if self.ids else None, "prompt_text": None}
            yield _sse(first), 0
        sequence, made = list(self.prompt), 0
        while made < self.max_tokens:
            tokens, text = [], ""
            while len(tokens) < per_chunk and made + len(tokens) < self.max_tokens:
                token = self.rng.randrange(4, 64) if self.rng else next_token(sequence)
                sequence.append(token)
                tokens.append(token)
                text += self.detok.step(token)
            finish = "length" if made + len(tokens) >= self.max_tokens else None
            yield self.chunk(tokens, text, finish), made
            made += len(tokens)
        if self.include_usage:
            usage = {"prompt_tokens": len(self.prompt), "total_tokens": len(self.prompt) + made,
                     "completion_tokens": made}
            yield _sse({**self.head(), "choices": [], "usage": usage,
                        "system_fingerprint": "toy-0.32"}), made
        yield b"data: [DONE]\n\n", made


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"
