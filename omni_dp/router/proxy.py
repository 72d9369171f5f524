"""Forwarding one request to one replica, byte for byte, and streaming the answer back.

Rules that matter for a fleet of same-GPU replicas:
- admission is checked before the body is read (over the bound → 503 + Retry-After at once)
  and taken only once the body is in: a slow sender holds a reader slot (its own bound, and
  --body-timeout), never an in-flight slot that real requests need;
- the body and end-to-end headers go upstream untouched; nothing is re-serialised;
- the response is relayed chunk by chunk as it arrives (aiohttp sets TCP_NODELAY both ways);
- one retry, on another replica, only when the connection failed before any byte was sent;
- a replica failing mid-stream ends the response with an error (SSE error event, or a chunked
  stream without its terminator), never a short "success";
- a client that hangs up cancels the upstream request at once (the connection is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import sys
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from omni_dp.logs import FIELDS
from omni_dp.router.health import record_failure, record_success
from omni_dp.router.policies import RequestContext
from omni_dp.router.replicas import Replica

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

log = logging.getLogger("omni_dp.router.access")

REQUEST_ID = "X-Request-ID"
REPLICA_HEADER = "X-Omni-DP-Replica"
# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes for the new hop.
_HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Proxy-Connection", "Host", "Content-Length",
))
# Headers aiohttp's client adds on its own; skipped unless the client sent them.
_CLIENT_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_UPSTREAM_FAILURE_STATUSES = (502, 504)
# Bodies of known length up to this size are read whole and sent with the headers in one
# write (one syscall fewer per small JSON answer); anything else is streamed as it arrives.
_WHOLE_BODY_LIMIT = 64 * 1024


def end_to_end(headers) -> CIMultiDict:
    """Copy headers minus hop-by-hop ones, including any the Connection header names."""
    dropped = _HOP_BY_HOP
    if "Connection" in headers:
        dropped = dropped | {
            token.strip().lower()
            for value in headers.getall("Connection")
            for token in value.split(",")
        }
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def json_error(status: int, message: str, code: str, request_id: str | None = None,
               retry_after: bool = False) -> web.Response:
    headers = {REQUEST_ID: request_id} if request_id else {}
    if retry_after:
        headers["Retry-After"] = "1"
    body = {"error": {"message": message, "type": code, "code": status}}
    return web.json_response(body, status=status, headers=headers)


@dataclass
class RouteRecord:
    """Everything the completion log line says about one request."""

    request_id: str
    method: str
    path: str
    replica: str | None = None
    status: int = 0
    outcome: str = "ok"
    attempts: int = 0
    bytes: int = 0
    ttfb_s: float | None = None
    duration_s: float = 0.0

    def log(self) -> None:
        if log.isEnabledFor(logging.INFO):  # skip the JSON encoding when nobody reads it
            line = {"event": "route", **self.__dict__,
                    "client_disconnected": self.outcome == "client_disconnected"}
            log.info("%s", json.dumps(line, separators=(",", ":")), extra={FIELDS: line})


class _UpstreamFailed(Exception):
    """The replica broke the exchange; `retryable` only if no request byte left the router."""

    def __init__(self, kind: str, detail: str, retryable: bool) -> None:
        super().__init__(detail)
        self.kind = kind
        self.retryable = retryable


async def _write_sse_error(response: web.StreamResponse, message: str, kind: str,
                           code: int) -> None:
    """The event that ends a cut SSE stream: `data: {"error": {...}}`."""
    event = {"error": {"message": message, "type": kind, "code": code}}
    with contextlib.suppress(OSError):  # the client may be gone too
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


class Forwarder:
    def __init__(self, router) -> None:
        self.router = router  # omni_dp.router.app.Router: replicas, policy, session, metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        router = self.router
        started = time.perf_counter()
        request_id = request.headers.get(REQUEST_ID) or secrets.token_hex(16)
        record = RouteRecord(request_id, request.method, request.path)
        try:
            return await self._route(request, record, started)
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

    def _reject(self, record: RouteRecord, reason: str, message: str) -> web.Response:
        self.router.metrics.rejections.labels(reason).inc()
        record.status, record.outcome = 503, reason
        return json_error(503, message, reason, record.request_id, retry_after=True)

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
        timeout = router.config.body_timeout_s
        with router.reading():
            try:
                # A timeout scope, not wait_for: wait_for reads in a task of its own, and a
                # client hanging up would then surface as ConnectionResetError, not a cancel.
                async with _timeout(timeout):
                    return await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                record.status, record.outcome = 413, "body_too_large"
                return json_error(413, exc.text or "request body too large",
                                  "body_too_large", record.request_id)
            except asyncio.TimeoutError:
                record.status, record.outcome = 408, "body_timeout"
                response = json_error(
                    408, f"the request body did not arrive within {timeout:g} s "
                         "(--body-timeout)", "body_timeout", record.request_id)
                response.force_close()  # what is left of the body is not worth waiting for
                return response

    async def _route(self, request: web.Request, record: RouteRecord, started: float):
        router = self.router
        # Checked before the body is read (a full router answers at once), taken after it.
        rejection = router.admission_problem()
        if rejection is not None:
            return self._reject(record, *rejection)
        body = await self._read_body(request, record)
        if isinstance(body, web.StreamResponse):
            return body
        rejection = router.admission_problem()  # again: the body may have taken a while
        if rejection is not None:
            return self._reject(record, *rejection)

        with router.admitted():
            headers = end_to_end(request.headers)
            headers[REQUEST_ID] = record.request_id
            skip = [h for h in _CLIENT_AUTO_HEADERS if h not in request.headers]
            ctx = RequestContext(path=request.path, request_id=record.request_id)
            tried: set[str] = set()
            while True:
                replica = router.select(ctx, exclude=tried)
                if replica is None:
                    reason = "no_routable_replica" if not tried else "retry_exhausted"
                    router.metrics.rejections.labels(reason).inc()
                    record.status, record.outcome = 503, reason
                    return json_error(503, "no replica can take this request now", reason,
                                      record.request_id, retry_after=True)
                tried.add(replica.id)
                record.replica, record.attempts = replica.id, record.attempts + 1
                try:
                    return await self._exchange(
                        request, replica, body, headers, skip, record, started)
                except _UpstreamFailed as exc:
                    router.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                    record_failure(replica, router.config.health, f"{exc.kind}: {exc}")
                    retry = exc.retryable and router.config.retry_connect_failures
                    if retry and record.attempts == 1:
                        router.metrics.retries.inc()
                        continue
                    record.status, record.outcome = 502, exc.kind
                    router.metrics.requests.labels(replica.id, "502").inc()
                    return json_error(502, f"replica {replica.id} failed: {exc}", exc.kind,
                                      record.request_id)

    async def _exchange(self, request, replica: Replica, body: bytes, headers, skip,
                        record: RouteRecord, started: float) -> web.StreamResponse:
        router = self.router
        with replica.dispatched():
            try:
                # encoded=True: the path and query go upstream exactly as the client wrote them
                # (no requoting, no dot-segment resolution).
                target = URL(replica.url + request.raw_path, encoded=True)
                upstream = await router.session.request(
                    request.method, target,
                    data=body, headers=headers, skip_auto_headers=skip, allow_redirects=False,
                )
            except aiohttp.ClientConnectorError as exc:
                raise _UpstreamFailed("connect_error", str(exc), retryable=True) from None
            except aiohttp.ConnectionTimeoutError:  # before asyncio.TimeoutError: a subclass
                raise _UpstreamFailed("connect_timeout", "no connection in time",
                                      retryable=True) from None
            except asyncio.TimeoutError:
                raise _UpstreamFailed("timeout", "no response in time", retryable=False) from None
            except aiohttp.ClientError as exc:
                raise _UpstreamFailed("upstream_error", f"{type(exc).__name__}: {exc}",
                                      retryable=False) from None
            try:
                return await self._relay(request, replica, upstream, record, started)
            finally:
                upstream.close()  # no-op after a full read; cuts the replica off otherwise

    async def _relay(self, request, replica: Replica, upstream: aiohttp.ClientResponse,
                     record: RouteRecord, started: float) -> web.StreamResponse:
        router = self.router
        status = upstream.status
        record.status = status
        if status >= 400:  # relayed as-is, but not an "ok" in the route log
            record.outcome = "replica_4xx" if status < 500 else "replica_5xx"
        router.metrics.requests.labels(replica.id, str(status)).inc()
        if status in _UPSTREAM_FAILURE_STATUSES:
            record_failure(replica, router.config.health, f"answered {status}")
        elif status != 503:
            # A 503 is neither: no failure (a full replica is not a broken one), and no proof
            # of health either, or steady traffic to a replica that answers 503 to requests
            # and to /health alike (a router with no replica left, a draining server) would
            # clear every failed check and keep it in the rotation for good.
            record_success(replica, router.config.health, probe=False)

        headers = end_to_end(upstream.headers)
        headers[REQUEST_ID] = record.request_id
        headers[REPLICA_HEADER] = replica.id
        length = upstream.content_length
        if length is not None and length <= _WHOLE_BODY_LIMIT:
            return await self._relay_whole(request, replica, upstream, headers, record, started)
        response = web.StreamResponse(status=status, reason=upstream.reason, headers=headers)
        bodiless = request.method == "HEAD" or status in (204, 304) or 100 <= status < 200
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        elif request.version >= aiohttp.HttpVersion11 and not bodiless:
            response.enable_chunked_encoding()
        is_sse = upstream.content_type == "text/event-stream"
        await response.prepare(request)
        try:
            while True:
                # Reading from the replica and writing to the client fail for different
                # reasons and mean different things: keep them in separate try blocks.
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                        asyncio.TimeoutError) as exc:
                    return await self._fail_midstream(request, response, replica, record,
                                                      is_sse, exc)
                if not chunk:
                    break
                if record.ttfb_s is None:
                    self._first_byte(record, started)
                try:
                    await response.write(chunk)
                except ConnectionResetError:  # the client left (aiohttp's subclass included)
                    record.outcome = "client_disconnected"
                    router.metrics.client_disconnects.inc()
                    return response  # `finally` in _exchange closes the upstream connection
                record.bytes += len(chunk)
        except asyncio.CancelledError:
            if router.cutting_off and is_sse:  # the drain deadline, not the client leaving
                message = (f"the router is stopping: its drain timeout ({router.drain_s:g}s) "
                           "cut this stream off")
                await _write_sse_error(response, message, "drain_timeout", 503)
                if request.transport is not None:
                    request.transport.close()  # no terminating chunk: not a short success
            raise
        await response.write_eof()
        return response

    async def _relay_whole(self, request, replica: Replica, upstream: aiohttp.ClientResponse,
                           headers, record: RouteRecord, started: float) -> web.StreamResponse:
        """A small body of known length: headers and body leave in one write."""
        try:
            body = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                asyncio.TimeoutError) as exc:
            # Nothing was sent to the client yet: a clean 502 beats a broken stream.
            self._midstream_failure(replica, record, f"body read failed: {exc}")
            record.status = 502
            return json_error(502, f"replica {replica.id} failed while answering",
                              "upstream_failed", record.request_id)
        self._first_byte(record, started)
        record.bytes = len(body)
        return web.Response(body=body, status=upstream.status, reason=upstream.reason,
                            headers=headers)

    async def _fail_midstream(self, request, response, replica, record, is_sse, exc):
        detail = f"replica {replica.id} failed mid-stream: {type(exc).__name__}"
        self._midstream_failure(replica, record, detail)
        if is_sse:
            await _write_sse_error(response, detail, "upstream_failed", 502)
        # No terminating chunk: the client sees a broken response, not a short success.
        if request.transport is not None:
            request.transport.close()
        return response

    def _midstream_failure(self, replica: Replica, record: RouteRecord, reason: str) -> None:
        """The replica failed after it began answering: a replica failure, kind `midstream`."""
        self.router.metrics.upstream_errors.labels(replica.id, "midstream").inc()
        record_failure(replica, self.router.config.health, reason)
        record.outcome = "upstream_failed_midstream"

    def _first_byte(self, record: RouteRecord, started: float) -> None:
        """Record the time to the first body byte (the whole body, when it is read whole)."""
        record.ttfb_s = round(time.perf_counter() - started, 6)
        self.router.metrics.ttfb.observe(record.ttfb_s)
