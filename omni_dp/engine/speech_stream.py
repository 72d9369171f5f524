"""GET /v1/audio/speech/stream: a speech session over a WebSocket, text in as it is written.

An LLM's answer reaches the voice token by token; waiting for the whole text before speaking
wastes its first seconds. Here each sentence is spoken as soon as it is complete: the pieces
accumulate, the voice's own sentence splitter (engine/voice/phonemes.py) says where sentences
end, and each complete one goes through the same prepare → synthesize → encoder path as a POST
of that sentence, in order. `input.done` flushes the rest and ends the session.

Every sentence goes out with its index and its span in the session's text, so the router knows
the boundaries and can move a session whose replica died to another one from the sentence that
was cut (router/speech_stream.py). The protocol, close codes and bounds: docs/contracts.md,
"Speech session".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import WSMsgType, web

from omni_dp.contract import Priority
from omni_dp.engine.api import ApiError, SpeechParams
from omni_dp.engine.audio import StreamEncoder
from omni_dp.engine.pipeline import EngineFailed, RequestCutOff
from omni_dp.engine.preprocess import PreprocessError, SpeechAsk
from omni_dp.engine.voice.phonemes import split_sentences
from omni_dp.speech_stream import (
    AUDIO_DONE,
    AUDIO_START,
    CONFIG_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    SESSION_DONE,
    CloseCode,
    InputDone,
    StreamConfig,
    StreamMessageError,
    TextPiece,
    decode_client,
    error_event,
)


class _Server(Protocol):
    """What a session reads of engine/server.py's ReplicaServer (which registers the route: an
    import of it here would be a cycle)."""

    pipeline: Any  # Pipeline or VoicePipeline: prepare, synthesize
    options: Any  # ServeOptions: max_input_chars
    plan: Any  # ServePlan: sample_rate
    metrics: Any  # ReplicaMetrics: count_priority

    def not_ready(self) -> ApiError | None: ...  # POST's admission, by the same checks
    def full(self) -> ApiError | None: ...
    def refused(self, exc: ApiError) -> web.Response: ...  # and its answer
    def speech_params(self, raw: bytes) -> SpeechParams: ...  # POST's body check
    def priority_of(self, request: web.Request) -> Priority: ...  # POST's header check

log = logging.getLogger("omni_dp.serve.speech_stream")

# Text waiting to be spoken (complete sentences queued, plus the unfinished one) may be this
# many times --max-input-chars: an LLM writes far faster than speech is spoken, and a session
# must still not hold unbounded text.
BUFFERED_INPUTS = 16
# Appended to the unfinished text before splitting: a part equal to it means the text ends
# exactly on a sentence boundary (a terminator and whitespace), so the last sentence is whole.
_SENTINEL = "\x00"
_LONE_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Sentence:
    """One complete sentence: its index in the session and its span in the session's text."""

    index: int
    text: str
    start: int
    end: int


class SentenceBuffer:
    """The session's text as it arrives → complete sentences, with their spans.

    The sentences are exactly split_sentences() of the whole text, however it was cut into
    pieces: a sentence is complete once whitespace follows its terminator, and the rest waits.
    """

    def __init__(self) -> None:
        self.pending = ""  # text not yet in a sentence
        self.pending_at = 0  # where `pending` starts in the session's text
        self.count = 0  # sentences made so far

    def add(self, piece: str) -> list[Sentence]:
        self.pending += piece
        parts = split_sentences(self.pending + _SENTINEL)
        # The last part is the sentinel alone (the text ends on a boundary) or the unfinished
        # sentence with the sentinel on it: either way not a sentence.
        return self._take(parts[:-1], consume_all=parts[-1] == _SENTINEL)

    def flush(self) -> list[Sentence]:
        return self._take(split_sentences(self.pending), consume_all=True)

    def _take(self, parts: list[str], *, consume_all: bool) -> list[Sentence]:
        out, cursor = [], 0
        for part in parts:
            start = self.pending.index(part, cursor)
            cursor = start + len(part)
            out.append(Sentence(self.count, part, self.pending_at + start,
                                self.pending_at + cursor))
            self.count += 1
        if consume_all:
            used = len(self.pending)
        else:  # up to the unfinished sentence's first character
            rest = self.pending[cursor:]
            used = cursor + len(rest) - len(rest.lstrip())
        self.pending = self.pending[used:]
        self.pending_at += used
        return out


class SessionEnd(Exception):
    """The session closes now with `code`, after the error message `message` about `field`."""

    def __init__(self, code: CloseCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


_END = object()  # input.done: the speaker says session.done after the last sentence


class SpeechStreams:
    """The route's handler; one _Session per WebSocket. The timeouts: seconds to wait for
    session.config, then for each next message until input.done (vllm-omni's by default)."""

    def __init__(self, server: _Server, *, config_timeout_s: float = CONFIG_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.server = server
        self.config_timeout_s = config_timeout_s
        self.idle_timeout_s = idle_timeout_s

    async def handle(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, autoping=True)
        if not ws.can_prepare(request).ok:
            error = ApiError(426, "this is a WebSocket endpoint: send Upgrade: websocket")
            return web.json_response(error.body(), status=426)
        # Admission is POST's, before the upgrade: a replica that is not ready says it is
        # going away (the router opens the session elsewhere), a full one says so.
        refusal = server.not_ready() or server.full()
        if refusal is not None:
            return server.refused(refusal)
        try:  # the upgrade's X-Omni-DP-Priority: the class of every sentence of the session
            priority = server.priority_of(request)
        except ApiError as exc:
            return server.refused(exc)
        server.metrics.count_priority(priority)
        await ws.prepare(request)
        await _Session(self, ws, priority).run()
        return ws


class _Session:
    def __init__(self, streams: SpeechStreams, ws: web.WebSocketResponse,
                 priority: Priority = Priority.DEFAULT) -> None:
        server = self.server = streams.server
        self.priority = priority
        self.config_timeout_s = streams.config_timeout_s
        self.idle_timeout_s = streams.idle_timeout_s
        self.ws = ws
        self.params: SpeechParams | None = None
        self.stream_audio = False
        self.buffer = SentenceBuffer()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_chars = 0  # text of the sentences queued and not yet spoken
        self.done = False
        max_input = server.options.max_input_chars
        self.max_sentence = max_input
        self.max_buffered = BUFFERED_INPUTS * max_input

    async def run(self) -> None:
        try:
            await self._configure()
        except SessionEnd as end:
            await self._close(end)
            return
        reader = asyncio.create_task(self._read(), name="speech-stream-read")
        speaker = asyncio.create_task(self._speak(), name="speech-stream-speak")
        try:
            await asyncio.wait({reader, speaker}, return_when=asyncio.FIRST_COMPLETED)
            # Whichever ended first ends the other: a client gone cancels the sentence being
            # synthesized (its generator is closed, the engine aborts it).
            speaker.cancel()
            results = await asyncio.gather(speaker, return_exceptions=True)
            if reader.done():
                results.append(reader.exception() or reader.result())
            end = next((r for r in results if isinstance(r, SessionEnd)), None)
            if end is None:
                errors = [r for r in results if isinstance(r, BaseException)
                          and not isinstance(r, asyncio.CancelledError)]
                if errors:
                    log.error("speech session failed: %r", errors[0])
                    end = SessionEnd(CloseCode.INTERNAL, f"internal error: {errors[0]}")
            if end is not None:
                # The close ends a reader waiting in receive(): a cancel alone may be lost
                # there (aiohttp's receive can return a message that arrived as the cancel
                # came, and the reader would wait on with no timeout after input.done).
                await self._close(end)
        finally:
            speaker.cancel()
            reader.cancel()
            await asyncio.gather(reader, speaker, return_exceptions=True)

    async def _close(self, end: SessionEnd) -> None:
        if self.ws.closed:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            if end.code != CloseCode.NORMAL:
                await self.ws.send_str(error_event(str(end), end.field))
            await self.ws.close(code=end.code, message=str(end)[:120].encode())

    async def _receive(self, timeout: float | None) -> str | None:
        """The next text frame; None when the client is gone."""
        try:
            msg = await asyncio.wait_for(self.ws.receive(), timeout)
        except asyncio.TimeoutError:
            raise SessionEnd(CloseCode.POLICY, f"no message for {timeout:g} s; the session "
                             "ends (send input.done to finish a session)", "type") from None
        if msg.type == WSMsgType.TEXT:
            return msg.data
        if msg.type == WSMsgType.BINARY:
            raise SessionEnd(CloseCode.POLICY, "binary frames are not taken: send JSON text",
                             "message")
        if msg.type == WSMsgType.ERROR and getattr(msg.data, "code", None) == CloseCode.TOO_BIG:
            raise SessionEnd(CloseCode.TOO_BIG, f"a message is over {MAX_MESSAGE_BYTES} bytes",
                             "text")
        return None  # CLOSE, CLOSING, CLOSED, ERROR: the client is gone

    async def _configure(self) -> None:
        raw = await self._receive(self.config_timeout_s)
        if raw is None:
            raise SessionEnd(CloseCode.NORMAL, "client gone")
        try:
            message = decode_client(raw)
        except StreamMessageError as exc:
            raise SessionEnd(CloseCode.POLICY, str(exc), exc.field) from None
        if not isinstance(message, StreamConfig):
            raise SessionEnd(CloseCode.POLICY, "the first message must be session.config",
                             "type")
        self.params = self._params(message)
        self.stream_audio = message.stream_audio

    def _params(self, config: StreamConfig) -> SpeechParams:
        """session.config checked as POST checks its body (same fields, same messages)."""
        fields = {"response_format": "wav", **config.fields, "input": ""}
        try:
            params = self.server.speech_params(json.dumps(fields).encode())
        except ApiError as exc:
            raise SessionEnd(CloseCode.POLICY, exc.message, exc.field) from None
        if params.stream_format != "audio":
            raise SessionEnd(CloseCode.POLICY, "stream_format: a session's audio goes out in "
                             "binary frames; send stream_format audio or leave it out",
                             "stream_format")
        return params

    # --- the client's messages -----------------------------------------------------------
    async def _read(self) -> None:
        """Until the client is gone (returns) or a fatal error (raises SessionEnd)."""
        while True:
            raw = await self._receive(None if self.done else self.idle_timeout_s)
            if raw is None:
                return
            try:
                message = decode_client(raw)
            except StreamMessageError as exc:  # not fatal: the message is dropped, said so
                await self.ws.send_str(error_event(str(exc), exc.field))
                continue
            if isinstance(message, StreamConfig):
                await self.ws.send_str(error_event(
                    "session.config comes once, first; this one is ignored", "type"))
            elif self.done:
                await self.ws.send_str(error_event(
                    "input.done was sent: the session takes no more input", "type"))
            elif isinstance(message, TextPiece):
                self._take(message.text)
            elif isinstance(message, InputDone):
                self.done = True
                self._queue(self.buffer.flush())
                self.queue.put_nowait(_END)

    def _take(self, text: str) -> None:
        self._queue(self.buffer.add(text))
        if len(self.buffer.pending) > self.max_sentence:
            raise SessionEnd(CloseCode.TOO_BIG, f"{len(self.buffer.pending)} characters with "
                             f"no sentence end; a sentence may have {self.max_sentence} "
                             "(--max-input-chars)", "text")
        buffered = self.queued_chars + len(self.buffer.pending)
        if buffered > self.max_buffered:
            raise SessionEnd(CloseCode.TOO_BIG, f"{buffered} characters wait to be spoken; "
                             f"the bound is {self.max_buffered} (16 × --max-input-chars): "
                             "send text no faster than it is spoken", "text")

    def _queue(self, sentences: list[Sentence]) -> None:
        for sentence in sentences:
            self.queued_chars += len(sentence.text)
            self.queue.put_nowait(sentence)

    # --- speaking --------------------------------------------------------------------------
    async def _speak(self) -> None:
        """Speak the queued sentences in order; after input.done's last, session.done."""
        while True:
            item = await self.queue.get()
            if item is _END:
                await self.ws.send_json({"type": SESSION_DONE,
                                         "total_sentences": self.buffer.count})
                raise SessionEnd(CloseCode.NORMAL, "session done")
            self.queued_chars -= len(item.text)
            if (leaving := self.server.not_ready()) is not None:
                raise SessionEnd(CloseCode.GOING_AWAY, leaving.message, None)
            await self._sentence(item)

    async def _sentence(self, sentence: Sentence) -> None:
        params, server = self.params, self.server
        assert params is not None and server.pipeline is not None
        # A sentence's audio is what POST answers for its text: the same encoder (its rate is
        # the rate of the bytes it gives, as POST's X-Sample-Rate), a new one per sentence (one
        # file each for wav and the encoded formats).
        encoder = StreamEncoder(params.response_format, server.plan.sample_rate)
        total = 0
        try:
            await self.ws.send_json({
                "type": AUDIO_START, "sentence_index": sentence.index,
                "sentence_text": sentence.text, "format": params.response_format,
                "sample_rate": encoder.sample_rate, "text_start": sentence.start,
                "text_end": sentence.end})
            # only the session's first sentence opens what the client hears: a long one is
            # spoken in clause-sized pieces, a later one whole (it was complete before it
            # was asked for, and the one before it is still playing)
            ask = SpeechAsk(_LONE_SURROGATES.sub("", sentence.text), params.voice, params.speed,
                            params.seed, params.max_new_tokens,
                            opens_answer=sentence.index == 0)
            try:
                speech = await server.pipeline.prepare(ask)
            except PreprocessError as exc:  # this sentence can never be spoken: said, skipped
                await self.ws.send_str(error_event(str(exc), "text",
                                                   sentence_index=sentence.index))
                await self._sentence_done(sentence, 0, error=True)
                return
            held = bytearray(encoder.header())
            async with contextlib.aclosing(
                    server.pipeline.synthesize(speech, self.priority)) as chunks:
                async for chunk in chunks:
                    held += await encoder.feed_async(chunk)
                    if self.stream_audio and held:
                        total += len(held)
                        await self.ws.send_bytes(bytes(held))
                        held.clear()
            held += await encoder.finish_async()
            if held:
                total += len(held)
                await self.ws.send_bytes(bytes(held))
        except EngineFailed as exc:
            raise SessionEnd(CloseCode.INTERNAL, f"engine failed: {exc}") from None
        except RequestCutOff as exc:
            raise SessionEnd(CloseCode.GOING_AWAY, f"{exc}; the session goes on on another "
                             "replica") from None
        finally:
            encoder.close()
        # Only a sentence spoken whole (or refused, said above) is done: the router resumes a
        # session after the last audio.done, so a cut one must not get one.
        await self._sentence_done(sentence, total, error=False)

    async def _sentence_done(self, sentence: Sentence, total: int, *, error: bool) -> None:
        await self.ws.send_json({"type": AUDIO_DONE, "sentence_index": sentence.index,
                                 "total_bytes": total, "error": error})
