"""Forwarding one request to the replicas, byte for byte, and streaming the answer back.

Rules that matter for a fleet of same-GPU replicas:
- admission is checked before the body is read (over the bound → 503 + Retry-After at once)
  and taken only once the body is in: a slow sender holds a reader slot (its own bound, and
  --body-timeout), never an in-flight slot that real requests need;
- a request's class (classes.py: interactive, default, bulk) decides its wait for an
  in-flight slot when none is free for it: in its class's queue, served in class order,
  within its class's --queue-timeout (queues.py); a bulk request whose answer has not begun
  may be taken back for an interactive one that waits, and queues again (never failed for it);
- the body and end-to-end headers go upstream untouched; nothing is re-serialised (but the
  class header, and vLLM's `priority` field under --priority-field);
- the answer is relayed chunk by chunk as it arrives (aiohttp sets TCP_NODELAY both ways); its
  head leaves with its first body byte, so a replica that fails in between has sent the client
  nothing;
- a request whose replica failed before any byte reached the client is sent again, each time
  to a replica it was not sent to yet (or that was restarted since), up to --retries times
  within its deadline (--request-timeout): generation has no side effects;
- a request, retry or resume that finds no replica to go to waits for one (--replica-wait,
  within its deadline, in its in-flight slot): a replica's restart costs latency, not requests;
- after the first byte, an answer the request's resume strategy can continue (resume.py) is
  continued by another replica from the byte the client has (--resumes), or for an LLM
  stream from the tokens it has (--migration-limit; migration.py, token_stream.py); any other
  ends with an error (SSE error event, or a chunked stream without its terminator), never a
  short "success";
- a replica that answers nothing in time is checked and, hung, ejected at once (hangs.py);
- a client that hangs up cancels the upstream request at once (the connection is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from omni_dp.contract import GOING_AWAY_HEADER, PRIORITY_HEADER, BadPriority, Priority
from omni_dp.router.audio_slo import RelayedAudio
from omni_dp.router.classes import PRIORITY_FIELD_PATHS, with_priority_field
from omni_dp.router.exchange import Exchange, Head, RouteRecord, UpstreamFailed
from omni_dp.router.hangs import HangTimeout
from omni_dp.router.health import connection_refused, record_failure, record_success
from omni_dp.router.migration import plan_migration
from omni_dp.router.policies import RequestContext
from omni_dp.router.replicas import Replica
from omni_dp.router.resume import (
    SEED_RESPONSE_HEADER,
    ContinuationRefused,
    ReplicaErrorEvent,
    choose,
)
from omni_dp.router.tracing import RequestTrace

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

REQUEST_ID = "X-Request-ID"
REPLICA_HEADER = "X-Omni-DP-Replica"
# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes for the new hop.
_HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Proxy-Connection", "Host", "Content-Length",
))
# Headers aiohttp's client adds on its own: the upstream session skips them (its
# skip_auto_headers), so only those the client sent go upstream. Set once on the session, not
# per request: a per-request skip list costs aiohttp a set and a header copy every time.
CLIENT_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_UPSTREAM_FAILURE_STATUSES = (502, 504)
# Bodies of known length up to this size are read whole and sent with the headers in one
# write (one syscall fewer per small JSON answer); anything else is streamed as it arrives.
_WHOLE_BODY_LIMIT = 64 * 1024
# Reading the replica's answer failed: it cut the connection (or its deadline passed).
_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)
# Seeded from the OS once per process (each router worker process has its own).
_ids = random.Random()


def end_to_end(headers) -> CIMultiDict:
    """Copy headers minus hop-by-hop ones, including any the Connection header names.

    A C-level copy with the few hop-by-hop names deleted (case-insensitively, in the C
    multidict) costs a quarter of a Python filter over every header: it runs twice per request.
    """
    out = CIMultiDict(headers)
    dropped: Iterable[str] = _HOP_BY_HOP
    if "Connection" in headers:
        dropped = _HOP_BY_HOP | {
            token.strip()
            for value in headers.getall("Connection")
            for token in value.split(",")
        }
    for name in dropped:
        if name in out:
            del out[name]
    return out


def why_no_replica(router, wait_s: float) -> str | None:
    """Why a request that looked for a replica (waiting up to `wait_s`) found none, when that
    is not simply that none was there: the router is stopping, or its wait ran out."""
    if router.stopping and router.config.replica_wait_s > 0:
        return "stopping"
    if wait_s > 0:
        return "replica_wait_timeout"
    return None


def wait_words(router, wait_s: float) -> str:
    """What bounded a wait for a replica, for the messages."""
    bound = ("--replica-wait" if wait_s >= router.config.replica_wait_s
             else "what was left of --request-timeout")
    return f"within {wait_s:g} s ({bound})"


def refuse_no_replica(router, record: RouteRecord, wait_s: float, what: str) -> web.Response:
    """The 503 + Retry-After for a request no replica could take before its first byte; a
    router that is stopping says it is going away, so a router in front sends it elsewhere."""
    reason = why_no_replica(router, wait_s)
    headers = None
    if reason == "stopping":
        message = "the router is shutting down; retry"
        headers = {GOING_AWAY_HEADER: "draining"}
    elif reason == "replica_wait_timeout":
        message = f"no replica could take this {what} {wait_words(router, wait_s)}; retry"
    else:
        reason = "retry_exhausted" if record.tried else "no_routable_replica"
        message = f"no replica can take this {what} now"
    router.metrics.rejections.labels(reason).inc()
    record.status, record.outcome = 503, reason
    return json_error(503, message, reason, record.request_id, retry_after=True,
                      headers=headers)


def json_error(status: int, message: str, code: str, request_id: str | None = None,
               retry_after: bool = False, headers: dict | None = None) -> web.Response:
    headers = dict(headers or {})
    if request_id:
        headers[REQUEST_ID] = request_id
    if retry_after:
        headers["Retry-After"] = "1"
    body = {"error": {"message": message, "type": code, "code": status}}
    return web.json_response(body, status=status, headers=headers)


async def _write_sse_error(response: web.StreamResponse, message: str, kind: str,
                           code: int) -> None:
    """The event that ends a cut SSE stream: `data: {"error": {...}}`."""
    event = {"error": {"message": message, "type": kind, "code": code}}
    with contextlib.suppress(OSError):  # the client may be gone too
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


class Preempted(Exception):
    """A bulk request's attempt was taken back for an interactive request (its replica's id):
    it queues again, at the head of the bulk queue."""


class Forwarder:
    def __init__(self, router) -> None:
        self.router = router  # omni_dp.router.app.Router: replicas, policy, session, metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        router = self.router
        started = time.perf_counter()
        # A request id needs to be unique, not secret: no getrandom syscall per request.
        request_id = request.headers.get(REQUEST_ID) or f"{_ids.getrandbits(128):032x}"
        record = RouteRecord(request_id, request.method, request.path)
        trace = None if router.tracer is None else RequestTrace(router.tracer, request, record)
        try:
            return await self._route(request, record, started, trace)
        except asyncio.CancelledError:
            if router.cutting_off:
                record.outcome = "drain_cut_off"
            else:
                record.outcome = "client_disconnected"
                router.metrics.client_disconnects.inc()
            raise
        finally:
            record.duration_s = round(time.perf_counter() - started, 6)
            router.metrics.duration.observe(record.duration_s)
            record.log()
            if trace is not None:
                trace.end(record)

    def _reject(self, record: RouteRecord, reason: str, message: str) -> web.Response:
        self.router.metrics.rejections.labels(reason).inc()
        record.status, record.outcome = 503, reason
        # A router that is stopping is going away: a router in front sends the request on.
        headers = {GOING_AWAY_HEADER: "draining"} if reason == "stopping" else None
        return json_error(503, message, reason, record.request_id, retry_after=True,
                          headers=headers)

    async def _read_body(self, request: web.Request, record: RouteRecord) -> bytes | web.Response:
        """The whole body, bounded in size (client_max_size), time and concurrent readers; or
        the error response to send instead."""
        if not request.body_exists:
            return b""
        router = self.router
        bound = router.config.body_reader_bound(len(router.replicas))
        if router.num_reading >= bound:
            return self._reject(record, "readers_full",
                                f"the router is reading {bound} request bodies; retry shortly")
        if request.content.is_eof():
            # All of it arrived with the head (a small body): the read returns without
            # waiting, so no reader slot is held, no timeout armed, nothing for the drain cut.
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                return self._too_large(record, exc)
        timeout = router.config.body_timeout_s
        with router.reading():
            try:
                # A timeout scope, not wait_for: wait_for reads in a task of its own, and a
                # client hanging up would then surface as ConnectionResetError, not a cancel.
                async with _timeout(timeout):
                    return await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                return self._too_large(record, exc)
            except asyncio.TimeoutError:
                record.status, record.outcome = 408, "body_timeout"
                response = json_error(
                    408, f"the request body did not arrive within {timeout:g} s "
                         "(--body-timeout)", "body_timeout", record.request_id)
                response.force_close()  # what is left of the body is not worth waiting for
                return response

    @staticmethod
    def _too_large(record: RouteRecord, exc: web.HTTPRequestEntityTooLarge) -> web.Response:
        record.status, record.outcome = 413, "body_too_large"
        return json_error(413, exc.text or "request body too large", "body_too_large",
                          record.request_id)

    async def _route(self, request: web.Request, record: RouteRecord, started: float,
                     trace: RequestTrace | None):
        router = self.router
        try:
            priority = router.priority_rules.resolve(request.headers, request.path)
        except BadPriority as exc:
            record.status, record.outcome = 400, "invalid_priority"
            return json_error(400, str(exc), "invalid_priority", record.request_id)
        record.priority = priority.label
        # Checked before the body is read (a full router answers at once), taken after it.
        rejection = router.admission_problem(priority)
        if rejection is not None:
            return self._reject(record, *rejection)
        waited = not request.content.is_eof()
        body = await self._read_body(request, record)
        if isinstance(body, web.StreamResponse):
            return body
        if waited:  # again: the body may have taken a while (nothing changed if it was in)
            rejection = router.admission_problem(priority)
            if rejection is not None:
                return self._reject(record, *rejection)
        if not router.may_enter(priority):  # no slot for its class: it queues for one
            rejection = await self._queue(record, priority, router.config.queue_timeout(priority))
            if rejection is not None:
                return self._reject(record, *rejection)

        ex = None
        while True:
            with router.admitted():
                if ex is None:
                    ex = self._exchange(request, body, record, started, priority)
                    ex.trace = trace
                try:
                    return await self._forward(ex)
                except Preempted as exc:  # its slot goes to the interactive request waiting
                    ex.audio = None  # nothing of it reached the client: it starts again
                    if trace is not None:
                        trace.event("preempted", replica=str(exc))
                finally:
                    if ex.audio is not None:  # ended any other way than whole: interrupted
                        ex.audio.finish(False, record.replica)
            # back to the head of the bulk queue: never failed for it, within its deadline
            rejection = await self._queue(record, priority, ex.time_left(), head=True,
                                          bounded_by="what was left of --request-timeout")
            if rejection is not None:
                return self._reject(record, *rejection)
            ex.taken_back = False

    def _exchange(self, request: web.Request, body: bytes, record: RouteRecord,
              started: float, priority: Priority) -> Exchange:
        """The admitted request as it goes upstream (its body, headers, budgets)."""
        config = self.router.config
        if (config.priority_field and request.method == "POST"
                and request.path in PRIORITY_FIELD_PATHS):
            body = with_priority_field(body, priority,
                                       low_first=config.priority_field_order == "low-first")
        migration = plan_migration(request.method, request.path, body,
                                   config.migration_limit, config.migration_paths,
                                   config.migration_max_seq_len)
        if migration is not None:  # an LLM stream: it asks for its token ids
            body = migration.upstream_body(body)
        headers = end_to_end(request.headers)
        headers[REQUEST_ID] = record.request_id
        headers[PRIORITY_HEADER] = priority.label  # the engine schedules by it
        return Exchange(
            request, body, headers,
            record=record,
            ctx=RequestContext(path=request.path, request_id=record.request_id),
            started=started,
            deadline=asyncio.get_running_loop().time() + config.request_timeout_s,
            retries_left=config.retries, resumes_left=config.resumes,
            migrations_left=config.migration_limit, migration=migration,
            priority=priority,
        )

    async def _queue(self, record: RouteRecord, priority: Priority, timeout: float,
                     **how) -> tuple[str, str] | None:
        """Wait in the class's queue for an in-flight slot (Router.queue_for_slot)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self.router.queue_for_slot(priority, timeout, **how)
        finally:
            record.queued_s = round(record.queued_s + loop.time() - started, 6)

    async def _forward(self, ex: Exchange) -> web.StreamResponse:
        """Send the request to one replica after another until one answers it whole, or the
        budget (retries before the first byte, resumes after it, the deadline) is spent."""
        router = self.router
        try:
            while True:
                replica = router.select(ex.ctx)
                if replica is None:
                    wait_s = min(router.config.replica_wait_s, ex.time_left())
                    replica = await router.wait_for_replica(ex.ctx, wait_s, ex.record)
                    if replica is None:
                        return await self._no_replica(ex, wait_s)
                if ex.going_on is not None:
                    self._went_on(ex)
                ex.ctx.note_tried(replica)
                ex.record.tried.append(replica.id)
                ex.record.replica, ex.record.attempts = replica.id, ex.record.attempts + 1
                attempt = self._attempt if ex.trace is None else self._traced_attempt
                try:
                    if ex.priority is Priority.BULK:
                        return await self._preemptible_attempt(ex, replica, attempt)
                    return await attempt(ex, replica)
                except UpstreamFailed as exc:
                    router.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                    if exc.failure:
                        record_failure(replica, router.config.health, f"{exc.kind}: {exc}",
                                       refused=connection_refused(exc))
                    if not self._again(ex, exc):
                        return await self._give_up(ex, replica, exc)
        except asyncio.CancelledError:
            if router.cutting_off and ex.response is not None and ex.head.sse:
                # The drain deadline, not the client leaving: say so before the cut.
                message = (f"the router is stopping: its drain timeout ({router.drain_s:g}s) "
                           "cut this stream off")
                await _write_sse_error(ex.response, message, "drain_timeout", 503)
                self._close(ex)
            raise

    async def _preemptible_attempt(self, ex: Exchange, replica: Replica,
                                   attempt) -> web.StreamResponse:
        """A bulk request's attempt, in a task of its own that Router.preempt_bulk may cancel
        before the answer's first byte; Preempted when it did."""
        router = self.router
        task = asyncio.create_task(attempt(ex, replica))
        router.bulk_attempts[task] = ex
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the client left, or the drain cut: the attempt too
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
            raise
        finally:
            router.bulk_attempts.pop(task, None)
        if task.cancelled() and ex.taken_back:
            raise Preempted(replica.id)
        ex.taken_back = False  # it finished before the cancel reached it
        return task.result()

    def _again(self, ex: Exchange, exc: UpstreamFailed) -> bool:
        """Whether the request goes on to another replica (counted once one takes it)."""
        if not (exc.retryable and self._may_go_on(ex)):
            return False
        ex.going_on = exc.kind
        return True

    def _went_on(self, ex: Exchange) -> None:
        """A replica takes the request that goes on: count the retry, resume or migration,
        from its budget."""
        metrics, record = self.router.metrics, ex.record
        kind, ex.going_on = ex.going_on, None
        if ex.response is None:
            event, offset = "retry", None
            ex.retries_left -= 1
            metrics.retries.labels(kind).inc()
            record.retries.append(kind)
        elif ex.resume.migrates:
            event, offset = "migration", ex.resume.offset
            ex.migrations_left -= 1
            metrics.migrations.labels(kind).inc()
            record.migrations.append(kind)
            record.migrated_at = ex.resume.offset
        else:
            event, offset = "resume", ex.resume.offset
            ex.resumes_left -= 1
            metrics.resumes.labels(kind).inc()
            record.resumes.append(kind)
            record.resumed_from = ex.resume.offset
        if ex.trace is not None:
            ex.trace.event(event, reason=kind, offset=offset)

    def _may_go_on(self, ex: Exchange) -> bool:
        """Whether the budget lets the request go to another replica, and one is there now or
        may be waited for (--replica-wait)."""
        router = self.router
        if ex.time_left() <= 0:
            return False
        if router.config.replica_wait_s <= 0 and not router.candidates(ex.ctx):
            return False
        if ex.response is None:
            return ex.retries_left > 0
        return ex.resume.resumable and not ex.resume.complete and ex.continuations_left() > 0

    async def _no_replica(self, ex: Exchange, wait_s: float) -> web.StreamResponse:
        """No replica took the request within `wait_s`: a 503, or a stream begun ends cut."""
        router = self.router
        if ex.response is None:
            return refuse_no_replica(router, ex.record, wait_s, "request")
        # a resume with nowhere to go (the set changed meanwhile, or the wait ran out)
        why = why_no_replica(router, wait_s)
        if why == "stopping":
            message = "the router is stopping: no other replica can continue it"
        elif why == "replica_wait_timeout":
            message = f"no other replica could continue it {wait_words(router, wait_s)}"
        else:
            why, message = "no_replica", "no other replica can continue it"
        return await self._cut(ex, why, message)

    async def _give_up(self, ex: Exchange, replica: Replica,
                       exc: UpstreamFailed) -> web.StreamResponse:
        record = ex.record
        if ex.response is None:
            record.status, record.outcome = 502, exc.kind
            self.router.metrics.count_request(replica.id, 502)
            return json_error(502, f"replica {replica.id} failed: {exc}", exc.kind,
                              record.request_id)
        if ex.resume.complete:  # the answer's last event went out: only the end was lost
            with contextlib.suppress(ConnectionResetError):
                ending = ex.resume.ending()
                if ending:
                    await ex.response.write(ending)
                await ex.response.write_eof()
                self._completed(ex)
            return ex.response
        return await self._cut(ex, self._why_cut(ex, exc),
                               f"replica {replica.id} failed mid-stream: {exc}")

    def _why_cut(self, ex: Exchange, exc: UpstreamFailed) -> str:
        """Why a stream cut after its first byte was not resumed (a bounded label)."""
        if not ex.resume.resumable:
            return ex.resume.why_not
        if exc.kind == "resume_refused":
            return "resume_refused"
        if ex.continuations_left() <= 0:
            return "migrations_spent" if ex.resume.migrates else "resumes_spent"
        if ex.time_left() <= 0 or not exc.retryable:
            return "deadline"
        return "no_replica"

    async def _cut(self, ex: Exchange, why: str, message: str) -> web.StreamResponse:
        """End an answer the client already began to read as a broken one, never a short
        success: an SSE error event, then no terminating chunk."""
        self.router.metrics.streams_cut.labels(why).inc()
        ex.record.outcome, ex.record.cut = "upstream_failed_midstream", why
        if ex.head.sse:
            await _write_sse_error(ex.response, message, "upstream_failed", 502)
        self._close(ex)
        return ex.response

    @staticmethod
    def _close(ex: Exchange) -> None:
        if ex.request.transport is not None:
            ex.request.transport.close()

    # --- one attempt: one replica ------------------------------------------------------------
    async def _traced_attempt(self, ex: Exchange, replica: Replica) -> web.StreamResponse:
        """An attempt in its span (router/tracing.py), its traceparent sent upstream."""
        assert ex.trace is not None
        with ex.trace.attempt(ex, replica):
            return await self._attempt(ex, replica)

    async def _attempt(self, ex: Exchange, replica: Replica) -> web.StreamResponse:
        with replica.dispatched():
            upstream = await self._send(ex, replica)
            try:
                if ex.response is None:
                    return await self._answer(ex, replica, upstream)
                return await self._resumed(ex, replica, upstream)
            finally:
                upstream.close()  # no-op after a full read; cuts the replica off otherwise

    async def _send(self, ex: Exchange, replica: Replica) -> aiohttp.ClientResponse:
        """The request to `replica`; its answer's head, or UpstreamFailed."""
        router = self.router
        path, body, headers = ex.request.raw_path, ex.body, ex.headers
        if ex.response is not None:  # a resume from the byte the client has, or a migration
            resend = ex.resume.resend()
            headers = CIMultiDict(headers)
            headers.update(resend.headers)
            path, body = resend.path or path, resend.body if resend.body is not None else body
        left = ex.time_left()
        if left <= 0:
            raise UpstreamFailed("timeout", "the request's deadline passed", retryable=False,
                                 failure=False)
        # The session's own timeout is the whole --request-timeout: a later attempt, or one
        # that waited for its replica, gets what is left of it.
        timeout = None if ex.record.attempts == 1 and not ex.record.waited_s else \
            aiohttp.ClientTimeout(total=left, connect=min(router.config.connect_timeout_s, left))
        # encoded=True: the path and query go upstream exactly as the client wrote them (no
        # requoting, no dot-segment resolution).
        sending = router.session.request(
            ex.request.method, URL(replica.url + path, encoded=True),
            data=body, headers=headers, allow_redirects=False,
            **({"timeout": timeout} if timeout is not None else {}),
        )
        try:
            return await router.hangs.wait(replica, router.config.first_byte_timeout_s,
                                           sending, "status line")
        except HangTimeout as exc:
            raise UpstreamFailed("first_byte_timeout", str(exc), retryable=True,
                                 failure=False) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamFailed("connect_error", str(exc), retryable=True) from None
        except aiohttp.ConnectionTimeoutError:  # before asyncio.TimeoutError: a subclass
            raise UpstreamFailed("connect_timeout", "no connection in time",
                                 retryable=True) from None
        except asyncio.TimeoutError:
            raise UpstreamFailed("timeout", "no response in time", retryable=False) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # Closed or reset before its status line: nothing of the answer exists yet.
            raise UpstreamFailed("disconnected", f"{type(exc).__name__}: {exc}",
                                 retryable=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailed("upstream_error", f"{type(exc).__name__}: {exc}",
                                 retryable=False) from None

    async def _answer(self, ex: Exchange, replica: Replica,
                      upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """The request's first answer (nothing reached the client yet): relay it."""
        router, record = self.router, ex.record
        status = upstream.status
        router.metrics.count_request(replica.id, status)
        going_away = upstream.headers.get(GOING_AWAY_HEADER)
        if going_away is not None and status >= 500 and self._may_go_on(ex):
            raise UpstreamFailed("going_away", f"it answered {status}, going away "
                                 f"({going_away})", retryable=True, failure=False)
        record.status = status
        record.outcome = "ok" if status < 400 else "replica_4xx" if status < 500 else "replica_5xx"
        self._judge(replica, status)
        headers = end_to_end(upstream.headers)
        headers[REQUEST_ID] = record.request_id
        headers[REPLICA_HEADER] = replica.id
        record.seed = upstream.headers.get(SEED_RESPONSE_HEADER)
        ex.resume = choose(status, upstream.headers, ex.request.headers, ex.migration)
        ex.audio = RelayedAudio.of(router.metrics.audio, ex.request.method, ex.request.path,
                                   ex.body, status, upstream.headers, ex.priority.label,
                                   ex.started)
        length = upstream.content_length
        if ex.resume.migrates:  # its chunks are rewritten: their length is not the engine's
            length = None
        elif length is not None and length <= _WHOLE_BODY_LIMIT:
            return await self._relay_whole(ex, upstream, headers)
        bodiless = (ex.request.method == "HEAD" or status in (204, 304)
                    or 100 <= status < 200)
        ex.head = Head(status, upstream.reason, headers, length, bodiless,
                        sse=upstream.content_type == "text/event-stream")
        return await self._pump(ex, replica, upstream)

    def _judge(self, replica: Replica, status: int) -> None:
        """What an answer says of the replica's health."""
        health = self.router.config.health
        if status in _UPSTREAM_FAILURE_STATUSES:
            record_failure(replica, health, f"answered {status}")
        elif status != 503:
            # A 503 is neither: no failure (a full replica is not a broken one), and no proof
            # of health either, or steady traffic to a replica that answers 503 to requests
            # and to /health alike (a router with no replica left, a draining server) would
            # clear every failed check and keep it in the rotation for good.
            record_success(replica, health, probe=False)

    async def _resumed(self, ex: Exchange, replica: Replica,
                       upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Another replica's answer to a resume: relayed on if it is the rest of the same one."""
        self.router.metrics.count_request(replica.id, upstream.status)
        problem = ex.resume.check(upstream.status, upstream.headers)
        if problem is not None:
            raise UpstreamFailed("resume_refused", f"replica {replica.id} cannot resume: "
                                 f"{problem}", retryable=False, failure=False)
        record_success(replica, self.router.config.health, probe=False)
        return await self._pump(ex, replica, upstream)

    async def _relay_whole(self, ex: Exchange, upstream: aiohttp.ClientResponse,
                           headers) -> web.StreamResponse:
        """A small body of known length: headers and body leave in one write."""
        try:
            body = await upstream.read()
        except _READ_ERRORS as exc:  # nothing reached the client yet: it may go elsewhere
            raise UpstreamFailed("midstream", f"body read failed: {type(exc).__name__}",
                                 retryable=True) from None
        self._first_byte(ex)
        ex.record.bytes = len(body)
        if ex.audio is not None:  # the whole answer at once, as the handler returns
            ex.audio.wrote(body, ex.record.replica)
            self._completed(ex)
        return web.Response(body=body, status=upstream.status, reason=upstream.reason,
                            headers=headers)

    async def _pump(self, ex: Exchange, replica: Replica,
                    upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay the answer's body as it arrives, through the resume strategy."""
        loop = asyncio.get_running_loop()
        stall = self.router.config.stall_timeout_s
        with self.router.hangs.watch(replica, stall, "byte", upstream.close) as watch:
            while True:
                # Reading from the replica and writing to the client fail for different
                # reasons and mean different things: the reads fail here, the writes in _write.
                try:
                    chunk = await upstream.content.readany()
                except _READ_ERRORS as exc:
                    if watch.expired:  # found hung: the watch closed the connection
                        raise UpstreamFailed("stall_timeout", watch.message, retryable=True,
                                             failure=False) from None
                    raise UpstreamFailed("midstream", f"{type(exc).__name__}: {exc}",
                                         retryable=True) from None
                if not chunk:
                    break
                watch.touch(loop.time())
                try:
                    data = ex.resume.take(chunk)
                except ReplicaErrorEvent as exc:
                    raise UpstreamFailed("replica_error", str(exc), retryable=True) from None
                except ContinuationRefused as exc:
                    raise UpstreamFailed("resume_refused", str(exc), retryable=False,
                                         failure=False) from None
                if data and not await self._write(ex, data):
                    return ex.response  # the client left: _attempt closes the upstream
        short = ex.resume.at_end()
        if short is not None:  # closed cleanly, but before the answer's end
            raise UpstreamFailed("closed_early", short, retryable=True)
        rest = ex.resume.flush()
        if rest and not await self._write(ex, rest):
            return ex.response
        if ex.response is None and not await self._open(ex):
            return ex.response
        await ex.response.write_eof()
        self._completed(ex)
        return ex.response

    @staticmethod
    def _completed(ex: Exchange) -> None:
        """The answer reached the client whole: its audio counts as completed."""
        if ex.audio is not None:
            ex.audio.finish(True, ex.record.replica)

    async def _open(self, ex: Exchange) -> bool:
        """Send the head to the client (with its first body byte, or at the end); False when
        the client is gone."""
        head = ex.head
        response = web.StreamResponse(status=head.status, reason=head.reason,
                                      headers=head.headers)
        if head.content_length is not None:
            response.content_length = head.content_length
        elif ex.request.version >= aiohttp.HttpVersion11 and not head.bodiless:
            response.enable_chunked_encoding()
        ex.response = response
        try:
            await response.prepare(ex.request)
        except ConnectionResetError:
            self._client_left(ex)
            return False
        return True

    async def _write(self, ex: Exchange, data: bytes) -> bool:
        """`data` to the client; False when the client is gone (aiohttp's reset included)."""
        if ex.response is None and not await self._open(ex):
            return False
        try:
            await ex.response.write(data)
        except ConnectionResetError:
            self._client_left(ex)
            return False
        ex.resume.sent()
        if ex.audio is not None:
            ex.audio.wrote(data, ex.record.replica)
        if ex.record.ttfb_s is None:
            self._first_byte(ex)
        ex.record.bytes += len(data)
        return True

    def _client_left(self, ex: Exchange) -> None:
        ex.record.outcome = "client_disconnected"
        self.router.metrics.client_disconnects.inc()

    def _first_byte(self, ex: Exchange) -> None:
        """Record the time to the first body byte (the whole body, when it is read whole)."""
        ex.record.ttfb_s = round(time.perf_counter() - ex.started, 6)
        self.router.metrics.ttfb.observe(ex.record.ttfb_s)
