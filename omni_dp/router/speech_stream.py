"""The speech session (GET /v1/audio/speech/stream) through the router, and its move to another
replica when its replica is lost.

The router opens the session on a replica its policy picks (before it accepts the client's
upgrade, so a refusal is an ordinary HTTP 503), then relays both ways. It keeps what it needs to
move the session: the client's session.config, the text since the end of the last sentence the
client got whole, and whether input.done came. A replica that goes away mid-session (its
connection dropped, a kill -9, a close saying it is going away or failed) is replaced: a new
session on another replica gets the config, the text from the start of the cut sentence on, and
input.done if the client sent it; its sentences are renumbered to follow the client's, and the
first of them, when the client already had its audio.start, says `"resent": true` so the client
drops that sentence's partial audio. At most --resumes moves per session; then, or with no
replica left, an error and a close code saying why (docs/contracts.md, "Speech session").
Opening a session and moving it wait for a replica to go to as a request does (--replica-wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time

import aiohttp
from aiohttp import WSMsgType, web

from omni_dp.contract import PRIORITY_HEADER, BadPriority
from omni_dp.router.exchange import RouteRecord
from omni_dp.router.health import record_failure, record_success
from omni_dp.router.policies import RequestContext
from omni_dp.router.proxy import (
    REPLICA_HEADER,
    REQUEST_ID,
    json_error,
    refuse_no_replica,
    wait_words,
    why_no_replica,
)
from omni_dp.router.replicas import Replica
from omni_dp.speech_stream import (
    AUDIO_DONE,
    AUDIO_START,
    ERROR,
    MAX_MESSAGE_BYTES,
    MOVABLE_CLOSES,
    RESEND_PIECE_CHARS,
    SESSION_DONE,
    SPEECH_STREAM_PATH,
    CloseCode,
    InputDone,
    SentenceEvent,
    StreamConfig,
    StreamMessageError,
    TextPiece,
    decode_client,
    decode_server,
    error_event,
)

log = logging.getLogger("omni_dp.router.speech_stream")

# The text the router holds for a session (what is not yet spoken whole): far above a replica's
# own bound (16 × its --max-input-chars), so the replica's is the one a client meets.
MAX_HELD_CHARS = 1 << 20
# Client headers that go to the replica with the upgrade (the rest are the handshake's own).
_PASSED_HEADERS = ("Authorization", "X-API-Key")
_ids = random.Random()


class SpeechStreamProxy:
    """The route's handler: admission, then one _ProxiedSession per WebSocket."""

    def __init__(self, router) -> None:
        self.router = router  # omni_dp.router.app.Router

    async def handle(self, request: web.Request) -> web.StreamResponse:
        router = self.router
        request_id = request.headers.get(REQUEST_ID) or f"{_ids.getrandbits(128):032x}"
        record = RouteRecord(request_id, request.method, request.path)
        started = time.perf_counter()
        client = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES)
        try:
            if not client.can_prepare(request).ok:
                record.status, record.outcome = 426, "websocket_required"
                return json_error(426, "this is a WebSocket endpoint: send Upgrade: websocket",
                                  "websocket_required", request_id)
            try:
                priority = router.priority_rules.resolve(request.headers, request.path)
            except BadPriority as exc:
                record.status, record.outcome = 400, "invalid_priority"
                return json_error(400, str(exc), "invalid_priority", request_id)
            record.priority = priority.label
            rejection = router.admission_problem(priority)
            if rejection is None and not router.may_enter(priority):  # it queues for a slot
                waiting_since = time.perf_counter()
                rejection = await router.queue_for_slot(priority,
                                                        router.config.queue_timeout(priority))
                record.queued_s = round(time.perf_counter() - waiting_since, 6)
            if rejection is not None:
                reason, message = rejection
                router.metrics.rejections.labels(reason).inc()
                record.status, record.outcome = 503, reason
                return json_error(503, message, reason, request_id, retry_after=True)
            with router.admitted():
                session = _ProxiedSession(router, request, client, record)
                return await session.run()
        finally:
            record.duration_s = round(time.perf_counter() - started, 6)
            router.metrics.duration.observe(record.duration_s)
            record.log()


class _Upstream:
    """One replica's session: its WebSocket and its slot in the replica's in-flight count."""

    def __init__(self, replica: Replica, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.replica = replica
        self.ws = ws
        self._slot = replica.dispatched()
        self._slot.__enter__()
        self._released = False

    async def close(self) -> None:
        # The slot first: a close cancelled while it waits for the replica's close frame (a
        # drain cut-off, the session's timeout) must still give the slot back.
        if not self._released:
            self._released = True
            self._slot.__exit__(None, None, None)
        with contextlib.suppress(Exception):
            await self.ws.close()


class _ProxiedSession:
    def __init__(self, router, request: web.Request, client: web.WebSocketResponse,
                 record: RouteRecord) -> None:
        self.router = router
        self.request = request
        self.client = client
        self.record = record
        self.ctx = RequestContext(path=request.path, request_id=record.request_id)
        # What bounds its waits for a replica (the relay has its own --request-timeout).
        self.deadline = asyncio.get_running_loop().time() + router.config.request_timeout_s
        self.wait_s = 0.0  # the last wait's bound (0: it did not wait)
        self.upstream: _Upstream | None = None
        self.lock = asyncio.Lock()  # a client message and a move's resend never interleave
        # What a move needs.
        self.config: str | None = None  # the client's session.config, as it came
        self.text = ""  # the client's text from `text_at` on
        self.text_at = 0  # where `text` starts in the session's text
        self.done = False  # input.done came
        # The client's view of the sentences.
        self.base_index = 0  # the client's index of the current replica's sentence 0
        self.base_offset = 0  # where the current replica's text starts in the session's
        self.next_index = 0  # the sentence after the last one the client got whole
        self.resume_offset = 0  # where that sentence's text may start (the last one's end)
        self.open_index: int | None = None  # a sentence begun (audio.start) and not done
        self.open_end: int | None = None
        self.resent: int | None = None  # the sentence to mark `resent` when it starts again
        self.finished = False  # session.done went to the client
        self.client_gone = False
        self.held_error: str | None = None  # a replica's last error, until we know it stays

    # --- the session ---------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        router = self.router
        upstream = await self._open()
        if upstream is None:
            return refuse_no_replica(router, self.record, self.wait_s, "speech session")
        self.upstream = upstream
        self.client.headers[REQUEST_ID] = self.record.request_id
        self.client.headers[REPLICA_HEADER] = upstream.replica.id
        self.record.status = 101
        try:
            await self.client.prepare(self.request)
        except (ConnectionError, RuntimeError):
            await upstream.close()
            self.record.outcome = "client_disconnected"
            return self.client
        reader = asyncio.create_task(self._from_client(), name="speech-stream-client")
        limit = self.router.config.request_timeout_s
        try:
            async with asyncio.timeout(limit):
                await self._relay_all()
        except TimeoutError:
            await self._end(CloseCode.POLICY, f"the session lasted --request-timeout ({limit:g} "
                            "s); it ends here", "timeout")
        except asyncio.CancelledError:
            if self.router.cutting_off:
                self.record.outcome = "drain_cut_off"
                await self._end(CloseCode.GOING_AWAY, "the router is stopping: its drain "
                                "timeout cut this session off", "drain_timeout")
            raise
        finally:
            reader.cancel()
            # Shielded: the client's connection closing cancels this handler (the router runs
            # with handler cancellation), and the replica's session and its slot in the
            # in-flight count must be given back all the same.
            await asyncio.shield(self._close_all(reader))
        return self.client

    async def _close_all(self, reader: asyncio.Task) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()
        await asyncio.gather(reader, return_exceptions=True)

    async def _relay_all(self) -> None:
        moves_left = self.router.config.resumes
        while True:
            assert self.upstream is not None
            lost = await self._relay(self.upstream)
            if lost is None:
                return
            replica = self.upstream.replica
            async with self.lock:
                await self.upstream.close()
                self.upstream = None
            self.router.metrics.upstream_errors.labels(replica.id, "midstream").inc()
            record_failure(replica, self.router.config.health, f"speech session: {lost}")
            self.held_error = None  # the replica's last words: the session goes on
            if moves_left <= 0:
                await self._cut(CloseCode.BAD_GATEWAY, "resumes_spent", f"replica {replica.id} "
                                f"was lost ({lost}) and this session may move no more "
                                "(--resumes)")
                return
            upstream = await self._open()
            if upstream is None:
                await self._no_replica(replica, lost)
                return
            try:
                await self._resend(upstream)
            finally:
                if self.upstream is not upstream:  # cancelled before it was handed over
                    await upstream.close()
            moves_left -= 1
            self.router.metrics.resumes.labels("midstream").inc()
            self.record.resumes.append("midstream")
            self.record.resumed_from = self.resume_offset

    async def _no_replica(self, replica: Replica, lost: str) -> None:
        """The session's replica was lost and no other took it: the router is stopping (1001,
        a movable close: a router in front moves it), the wait ran out, or none was there."""
        why = why_no_replica(self.router, self.wait_s)
        lost_words = f"replica {replica.id} was lost ({lost})"
        if why == "stopping":
            await self._cut(CloseCode.GOING_AWAY, why, f"{lost_words} and the router is "
                            "stopping")
        elif why == "replica_wait_timeout":
            await self._cut(CloseCode.TRY_AGAIN, why, f"{lost_words} and no other replica "
                            f"could go on with this session {wait_words(self.router, self.wait_s)}")
        else:
            await self._cut(CloseCode.TRY_AGAIN, "no_replica", f"{lost_words} and no other "
                            "replica can go on with this session now")

    async def _cut(self, code: CloseCode, why: str, message: str) -> None:
        """A session its replica's loss ends: counted as a cut stream (`why`), then ended."""
        self.record.cut = why
        self.router.metrics.streams_cut.labels(why).inc()
        await self._end(code, message, why)

    async def _end(self, code: CloseCode, message: str, kind: str) -> None:
        """Tell the client why the session ends, then close with `code`."""
        self.record.outcome = kind
        if self.client.closed or self.client_gone:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.client.send_str(error_event(message, None, code=kind))
            await self.client.close(code=code, message=message[:120].encode())

    # --- opening a replica's session ----------------------------------------------------------
    async def _open(self) -> _Upstream | None:
        """A session on a replica the policy picks among those not tried yet; after a refusal
        or a connection error, the next one (--retries more at most)."""
        router, loop = self.router, asyncio.get_running_loop()
        for _ in range(1 + router.config.retries):
            replica = router.select(self.ctx)
            if replica is None:
                self.wait_s = min(router.config.replica_wait_s, self.deadline - loop.time())
                replica = await router.wait_for_replica(self.ctx, self.wait_s, self.record)
            if replica is None:
                return None
            self.ctx.note_tried(replica)
            self.record.tried.append(replica.id)
            self.record.replica, self.record.attempts = replica.id, self.record.attempts + 1
            headers = {REQUEST_ID: self.record.request_id,
                       PRIORITY_HEADER: self.record.priority}
            headers.update({name: self.request.headers[name] for name in _PASSED_HEADERS
                            if name in self.request.headers})
            stall = router.config.stall_timeout_s
            try:
                # No bound on the replica's frames: a sentence's audio is one frame (unless
                # stream_audio), as long as the sentence is, and its audio.start carries its
                # text; MAX_MESSAGE_BYTES bounds what a client sends.
                # The handshake is the session's first byte: a replica that does not answer
                # it within --first-byte-timeout (a stopped one not ejected yet) is passed
                # over, as a POST's would be; the heartbeat only starts after it.
                first_byte = router.config.first_byte_timeout_s
                ws = await asyncio.wait_for(router.session.ws_connect(
                    replica.url + SPEECH_STREAM_PATH, headers=headers,
                    max_msg_size=0, heartbeat=stall if stall > 0 else None,
                    timeout=aiohttp.ClientWSTimeout(ws_close=router.config.connect_timeout_s)),
                    first_byte if first_byte > 0 else None)
            except aiohttp.WSServerHandshakeError as exc:
                router.metrics.count_request(replica.id, exc.status)
                router.metrics.upstream_errors.labels(replica.id, "refused").inc()
                self.record.retries.append(f"refused_{exc.status}")
                continue
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                router.metrics.upstream_errors.labels(replica.id, "connect_error").inc()
                record_failure(replica, router.config.health,
                               f"speech session: {type(exc).__name__}: {exc}")
                self.record.retries.append("connect_error")
                continue
            router.metrics.count_request(replica.id, 101)
            record_success(replica, router.config.health, probe=False)
            return _Upstream(replica, ws)
        return None

    async def _resend(self, upstream: _Upstream) -> None:
        """The new replica's session: the config, the text from the cut sentence on, done.
        (A client gone meanwhile cancels this handler: run() closes what is open.)"""
        async with self.lock:
            self.base_index = self.next_index
            self.base_offset = self.resume_offset
            if self.open_index is not None:  # the client has part of it: it starts again
                self.resent = self.open_index
            self.open_index = self.open_end = None
            self.upstream = upstream
            self.record.replica = upstream.replica.id
            text = self.text[self.resume_offset - self.text_at:]
            try:
                if self.config is not None:
                    await upstream.ws.send_str(self.config)
                for start in range(0, len(text), RESEND_PIECE_CHARS):
                    piece = text[start:start + RESEND_PIECE_CHARS]
                    await upstream.ws.send_str(json.dumps({"type": "input.text",
                                                           "text": piece}))
                if self.done:
                    await upstream.ws.send_str(json.dumps({"type": "input.done"}))
            except (ConnectionError, RuntimeError):
                pass  # lost already: the relay finds it and moves again (or gives up)

    # --- client → replica ----------------------------------------------------------------------
    async def _from_client(self) -> None:
        client = self.client
        while True:
            msg = await client.receive()
            if msg.type == WSMsgType.TEXT:
                await self._client_text(msg.data)
                if client.closed:  # the router ended the session (too much text held)
                    await self._close_upstream()
                    return
            elif msg.type == WSMsgType.BINARY:
                await self._to_upstream(msg.data)  # the replica says it takes none
            elif msg.type == WSMsgType.CLOSING:
                return  # the router closes the client's socket itself (_end, _relay)
            else:  # CLOSE, CLOSED, ERROR: the client is gone
                # aiohttp closed it (1009) itself; the socket's close code may say 1006 after.
                if msg.type == WSMsgType.ERROR and getattr(msg.data, "code", None) == \
                        CloseCode.TOO_BIG:
                    self.record.outcome = "message_too_big"
                elif not self.finished:
                    self.client_gone = True
                    self.record.outcome = "client_disconnected"
                    self.router.metrics.client_disconnects.inc()
                await self._close_upstream()
                return

    async def _close_upstream(self) -> None:
        upstream = self.upstream
        if upstream is not None:
            await upstream.close()  # the replica cancels the sentence it speaks

    async def _client_text(self, raw: str) -> None:
        try:
            message = decode_client(raw)
        except StreamMessageError as exc:
            # Answered here, as the replica would, and not sent on: the text both keep stays
            # the same piece for piece.
            await self.client.send_str(error_event(str(exc), exc.field))
            return
        async with self.lock:
            if isinstance(message, StreamConfig) and self.config is None:
                self.config = raw
            elif isinstance(message, TextPiece) and not self.done and self.config is not None:
                held = len(self.text) + len(message.text)
                if held > MAX_HELD_CHARS:
                    await self._end(CloseCode.TOO_BIG, f"{held} characters of this session "
                                    f"are not spoken yet; the router holds {MAX_HELD_CHARS}",
                                    "text_too_long")
                    return
                self.text += message.text
            elif isinstance(message, InputDone) and self.config is not None:
                self.done = True
            await self._to_upstream(raw)

    async def _to_upstream(self, data: str | bytes) -> None:
        """To the current replica, if there is one (during a move the resend carries it)."""
        upstream = self.upstream
        if upstream is None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            if isinstance(data, bytes):
                await upstream.ws.send_bytes(data)
            else:
                await upstream.ws.send_str(data)

    # --- replica → client ----------------------------------------------------------------------
    async def _relay(self, upstream: _Upstream) -> str | None:
        """Relay one replica's messages until its session ends: None when the client's session
        ends with it, or why the replica was lost (the session moves)."""
        ws = upstream.ws
        while True:
            msg = await ws.receive()
            if msg.type == WSMsgType.TEXT:
                await self._replica_text(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await self._flush_error()
                await self._to_client_bytes(msg.data)
            else:
                reason = msg.extra if msg.type == WSMsgType.CLOSE and isinstance(
                    msg.extra, str) else ""
                break
        if self.client_gone or self.client.closed:
            return None
        code = ws.close_code
        if self.finished:
            await self._flush_error()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.client.close(code=CloseCode.NORMAL)
            self.record.outcome = "ok"
            return None
        if code is None or code == 1006 or code in MOVABLE_CLOSES:
            exc = ws.exception()
            return (f"closed {code}" if code is not None else
                    f"connection lost ({type(exc).__name__ if exc else 'no close frame'})")
        # The client's own fault (a bad config, an idle timeout, too much text): said by the
        # replica's error, closed with its code.
        await self._flush_error()
        self.record.outcome = f"closed_{code}"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.client.close(code=code, message=reason[:120].encode())
        return None

    async def _replica_text(self, raw: str) -> None:
        event = decode_server(raw)
        if isinstance(event, SentenceEvent):
            await self._flush_error()
            body = event.body
            index = self.base_index + event.index
            body["sentence_index"] = index
            for key in ("text_start", "text_end"):
                if isinstance(body.get(key), int):
                    body[key] += self.base_offset
            if event.kind == AUDIO_START:
                if index == self.resent:
                    body["resent"] = True
                    self.resent = None
                self.open_index = index
                self.open_end = body.get("text_end")
            elif event.kind == AUDIO_DONE:
                await self._sentence_done(index)
            await self._to_client(json.dumps(body))
            return
        if isinstance(event, dict) and event.get("type") == ERROR:
            if isinstance(event.get("sentence_index"), int):
                event["sentence_index"] += self.base_index
                await self._to_client(json.dumps(event))
            else:  # it may be the replica's last word before a close that moves the session
                await self._flush_error()
                self.held_error = json.dumps(event)
            return
        await self._flush_error()
        if isinstance(event, dict) and event.get("type") == SESSION_DONE:
            if isinstance(event.get("total_sentences"), int):
                event["total_sentences"] += self.base_index
            self.finished = True
            await self._to_client(json.dumps(event))
            return
        await self._to_client(raw)

    async def _sentence_done(self, index: int) -> None:
        """The client has sentence `index` whole: a move starts after it."""
        async with self.lock:
            self.next_index = index + 1
            if self.open_index == index and self.open_end is not None:
                self.resume_offset = self.open_end
                # The text before it is never sent again.
                cut = self.resume_offset - self.text_at
                if cut > 0:
                    self.text = self.text[cut:]
                    self.text_at = self.resume_offset
            self.open_index = self.open_end = None

    async def _flush_error(self) -> None:
        if self.held_error is not None:
            held, self.held_error = self.held_error, None
            await self._to_client(held)

    async def _to_client(self, data: str) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.client.send_str(data)

    async def _to_client_bytes(self, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.client.send_bytes(data)
            self.record.bytes += len(data)
