"""The router's forwarding path over real sockets: bytes, headers, streaming, failures, retry,
client disconnects, and the in-flight counts after each of them."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import re
import socket
import struct

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from support.http_client import client, fetch
from support.ports import LOOPBACK
from support.router import (
    Backend,
    backends,
    error_body,
    hold_if_asked,
    make_config,
    run,
    sample,
    scrape,
    serve,
    status_from_query,
    total,
)
from support.wait import until

RESPONSE_BODY = bytes(reversed(range(256))) * 33 + b"\x00\r\n\r\n"


async def mirror(backend: Backend, request: web.Request, seen) -> web.Response:
    """A fixed binary body and custom headers, so the test can check what comes back."""
    headers = [("X-Custom-Response", "kept  as-is; v=1"), ("Set-Cookie", "a=1"),
               ("Set-Cookie", "b=2"), ("Content-Type", "application/x-custom")]
    return web.Response(status=201, body=RESPONSE_BODY, headers=headers)


FORWARD_CASES = [
    ("POST", "/v1/audio/speech?stream=true&x=a%26b%3Dc&y=%20+z%25&e=", bytes(range(256)) * 64,
     "application/octet-stream"),
    ("GET", "/v1/models?limit=5", b"", None),
    ("POST", "/generate", b'{"text": "hi",  "zzz_unknown": [1, 2.50, "\\u00e9"], "n":null}',
     "application/json"),
    ("POST", "/v1/chat/completions?api-version=2024-01-01",
     json.dumps({"model": "m", "messages": [{"role": "user", "content": "é"}],
                 "future_field": {"deep": True}}, ensure_ascii=False).encode(),
     "application/json; charset=utf-8"),
    ("DELETE", "/v1/files/file-1", b"", None),
]


@pytest.mark.parametrize(("method", "path", "body", "content_type"), FORWARD_CASES)
def test_request_and_response_are_forwarded_byte_for_byte(method, path, body, content_type):
    async def main():
        async with backends(Backend("alpha", mirror)) as (backend,), \
                serve(make_config([f"alpha={backend.url}"])) as served, client() as session:
            headers = {"X-Custom": "custom  value, with comma", "X-Chunk-Delay-Ms": "25",
                       "User-Agent": "router-test/1.0", "X-Request-ID": "client-rid-42"}
            if content_type:
                headers["Content-Type"] = content_type
            async with session.request(method, URL(served.url + path, encoded=True),
                                       data=body or None, headers=headers) as resp:
                got = resp.status, resp.headers.copy(), await resp.read()
            await served.wait_idle()
            return got, backend.seen

    (status, headers, received), seen = run(main())
    assert len(seen) == 1
    upstream = seen[0]
    assert upstream.method == method
    assert upstream.raw_path == path
    assert upstream.body == body
    assert upstream.headers["X-Custom"] == "custom  value, with comma"
    assert upstream.headers["X-Chunk-Delay-Ms"] == "25"
    assert upstream.headers["User-Agent"] == "router-test/1.0"
    assert upstream.headers.getall("X-Request-ID") == ["client-rid-42"]
    if content_type:
        assert upstream.headers["Content-Type"] == content_type

    assert status == 201
    assert received == RESPONSE_BODY
    assert headers["Content-Type"] == "application/x-custom"
    assert headers["X-Custom-Response"] == "kept  as-is; v=1"
    assert headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert headers.getall("X-Request-ID") == ["client-rid-42"]
    assert headers["X-Omni-DP-Replica"] == "alpha"
    assert int(headers["Content-Length"]) == len(RESPONSE_BODY)


def test_a_replicas_cookies_reach_its_client_and_no_other_request():
    """The router's upstream session keeps no cookie jar: a Set-Cookie is the client's, never
    sent by the router with later requests (a shared jar would hand one client's session to
    every other). Addressed by host name: aiohttp's jar ignores cookies of IP addresses."""
    async def main():
        async with backends(Backend("alpha", mirror)) as (backend,):
            url = backend.url.replace(LOOPBACK, "localhost")
            async with serve(make_config([f"alpha={url}"])) as served:
                got = []
                for _ in range(2):
                    async with client() as session:  # two clients, no cookies of their own
                        _, headers, _ = await fetch(session, "POST", served.url + "/generate",
                                                    data=b"{}")
                        got.append(headers.getall("Set-Cookie"))
                await served.wait_idle()
                return got, [s.headers.get("Cookie") for s in backend.seen]

    set_cookies, upstream_cookies = run(main())
    assert set_cookies == [["a=1", "b=2"]] * 2
    assert upstream_cookies == [None, None]


def test_percent_encoding_in_path_and_query_is_forwarded_unchanged():
    path = "/v1/files/a%3Ab%2Ec%40d?sig=a%2Fb%7Ec%40&next=%2Fv1%2F"

    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url])) as served, client() as session:
            status, _, _ = await fetch(session, "GET", URL(served.url + path, encoded=True))
            assert status == 200
            return [s.raw_path for s in backend.seen]

    assert run(main()) == [path]


def test_hop_by_hop_headers_are_not_forwarded():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url])) as served, client() as session:
            headers = {
                "Connection": "keep-alive, X-Hop-Named",
                "X-Hop-Named": "secret",
                "Keep-Alive": "timeout=5",
                "Proxy-Authorization": "Basic Zm9vOmJhcg==",
                "TE": "trailers",
                "X-End-To-End": "yes",
            }
            status, _, _ = await fetch(session, "POST", served.url + "/generate", data=b"{}",
                                       headers=headers)
            assert status == 200
            # and with "Connection: close" from the client too
            status, _, _ = await fetch(session, "POST", served.url + "/generate", data=b"{}",
                                       headers={"Connection": "close", "X-End-To-End": "2"})
            assert status == 200
            return backend.seen

    seen = run(main())
    first, second = (s.headers for s in seen)
    for name in ("X-Hop-Named", "Keep-Alive", "Proxy-Authorization", "TE"):
        assert name not in first, name
    assert "x-hop-named" not in first.get("Connection", "").lower()
    assert first["X-End-To-End"] == "yes"
    assert second["X-End-To-End"] == "2"
    assert "close" not in second.get("Connection", "").lower()  # the client's hop, not ours


def test_request_id_is_generated_when_absent_and_forwarded():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url])) as served, client() as session:
            ids = []
            for _ in range(2):
                _, headers, _ = await fetch(session, "POST", served.url + "/v1/audio/speech",
                                            data=b"{}")
                ids.append(headers["X-Request-ID"])
            return ids, [s.headers.getall("X-Request-ID") for s in backend.seen]

    ids, upstream_ids = run(main())
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in ids), ids
    assert ids[0] != ids[1]
    assert upstream_ids == [[ids[0]], [ids[1]]]


def test_gzip_response_passes_through_still_compressed():
    payload = b"a compressible line of text\n" * 500
    compressed = gzip.compress(payload, mtime=0)

    async def gzipped(backend, request, seen):
        return web.Response(body=compressed, headers={"Content-Encoding": "gzip",
                                                      "Content-Type": "text/plain"})

    async def main():
        async with backends(Backend("a", gzipped)) as (backend,), \
                serve(make_config([backend.url])) as served:
            async with client(auto_decompress=False) as raw:
                status, headers, body = await fetch(
                    raw, "GET", served.url + "/v1/models", headers={"Accept-Encoding": "gzip"})
            async with client() as decoding:
                _, _, decoded = await fetch(decoding, "GET", served.url + "/v1/models")
            return status, headers, body, decoded

    status, headers, body, decoded = run(main())
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert body == compressed
    assert decoded == payload


# --- streaming ---------------------------------------------------------------------------------


def test_stream_chunks_reach_the_client_before_the_backend_finishes():
    finished = []

    async def gated(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await resp.prepare(request)
        await resp.write(b"first-chunk")
        await backend.release.wait()  # set by the client only once it holds the first chunk
        await resp.write(b"second-chunk")
        finished.append(True)
        await resp.write_eof()
        return resp

    async def main():
        async with backends(Backend("a", gated)) as (backend,), \
                serve(make_config([backend.url])) as served, client() as session:
            async with session.post(served.url + "/v1/audio/speech", data=b"{}") as resp:
                assert resp.status == 200
                first = await asyncio.wait_for(resp.content.readany(), 5)
                assert first == b"first-chunk"
                assert not finished
                backend.release.set()
                rest = await resp.read()
                assert resp.headers.get("Transfer-Encoding") == "chunked"
            assert rest == b"second-chunk"
            assert finished
            await served.wait_idle()

    run(main())


def test_sse_passes_through_event_by_event():
    events = [{"type": "speech.audio.delta", "i": i} for i in range(4)] + [{"type": "done"}]
    gates = []

    async def sse(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, event in enumerate(events):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await gates[i].wait()  # the next event only after the client got this one
        await resp.write_eof()
        return resp

    async def main():
        gates.extend(asyncio.Event() for _ in events)
        async with backends(Backend("a", sse)) as (backend,), \
                serve(make_config([backend.url])) as served, client() as session:
            got = []
            async with session.post(served.url + "/v1/audio/speech", data=b"{}") as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                assert resp.headers["Cache-Control"] == "no-cache"
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        got.append(json.loads(line[6:]))
                        gates[len(got) - 1].set()
            await served.wait_idle()
            return got

    assert run(main()) == events


# --- failures ----------------------------------------------------------------------------------


def test_error_responses_pass_through_and_leave_nothing_in_flight():
    async def main():
        async with backends(Backend("a", status_from_query)) as (backend,), \
                serve(make_config([f"a={backend.url}"], failures=1)) as served, \
                client() as session:
            for status in (404, 500, 400, 429, 503, 200):
                got, headers, body = await fetch(session, "POST",
                                                 served.url + f"/generate?status={status}")
                assert got == status
                assert json.loads(body) == {"status": status}  # the replica's body, not ours
                assert headers["X-Omni-DP-Replica"] == "a"
            await served.wait_idle()
            assert served.replica("a").routable  # none of these is a replica failure

    run(main())


def test_body_over_the_limit_gets_413():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], max_body_bytes=1024)) as served, \
                client() as session:
            status, _headers, body = await fetch(session, "POST", served.url + "/generate",
                                                data=b"x" * 4096)
            ok, _, _ = await fetch(session, "POST", served.url + "/generate", data=b"x" * 1000)
            await served.wait_idle()
            return status, body, ok, len(backend.seen)

    status, body, ok, seen = run(main())
    assert status == 413
    assert error_body(body)["code"] == 413
    assert ok == 200
    assert seen == 1  # the big one never went upstream


def midstream_death(content_type: str, length: int | None):
    """A handler that sends one piece, waits for the client to get it, then drops the
    connection as a crashing replica would."""

    async def handler(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await backend.release.wait()
        request.transport.close()
        return resp

    return handler


def test_sse_midstream_death_ends_with_an_error_event_and_a_broken_stream():
    async def main():
        backend = Backend("a", midstream_death("text/event-stream", None))
        async with backends(backend), serve(make_config([f"a={backend.url}"])) as served, \
                client() as session:
            events, broken = [], None
            async with session.post(served.url + "/v1/audio/speech", data=b"{}") as resp:
                assert resp.status == 200
                try:
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            events.append(json.loads(line[6:]))
                            backend.release.set()
                except aiohttp.ClientPayloadError as exc:
                    broken = exc
            await served.wait_idle()
            metrics = await scrape(session, served.url)
            return events, broken, served.replica("a").consecutive_failures, metrics

    events, broken, failures, metrics = run(main())
    assert events[0] == {"n": 1}
    assert len(events) == 2
    assert events[1]["error"]["code"] == 502
    assert "mid-stream" in events[1]["error"]["message"]
    assert broken is not None, "the stream ended cleanly after a replica failure"
    assert failures == 1
    assert sample(metrics, "omni_dp_router_upstream_errors_total",
                  replica="a", kind="midstream") == 1


@pytest.mark.parametrize("length", [None, 100_000], ids=["chunked", "content-length"])
def test_non_sse_midstream_death_fails_the_client_read(length):
    async def main():
        backend = Backend("a", midstream_death("application/octet-stream", length))
        async with backends(backend), serve(make_config([backend.url])) as served, \
                client() as session:
            async with session.post(served.url + "/v1/audio/speech", data=b"{}") as resp:
                assert resp.status == 200
                first = await resp.content.readany()
                backend.release.set()
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            await served.wait_idle()
            return first

    assert run(main()) == b'data: {"n": 1}\n\n'


@pytest.mark.parametrize("when", ["before_headers", "mid_body"])
def test_client_disconnect_cancels_the_upstream_request(when):
    cancelled = []

    async def slow(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        try:
            if when == "mid_body":
                await resp.prepare(request)
                await resp.write(b"tick")
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            backend.release.set()
            raise
        return resp

    async def main():
        backend = Backend("a", slow, cancellation=True)
        async with backends(backend), serve(make_config([backend.url])) as served, \
                client() as session:
            if when == "mid_body":
                resp = await session.post(served.url + "/v1/audio/speech", data=b"{}")
                assert await resp.content.readany() == b"tick"
                resp.close()  # hang up mid-stream
            else:
                task = asyncio.create_task(fetch(session, "POST", served.url + "/generate"))
                await until(lambda: len(backend.seen) == 1)
                task.cancel()  # hang up while waiting for the headers
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.wait_for(backend.release.wait(), 3)
            await served.wait_idle()
            return await scrape(session, served.url)

    metrics = run(main())
    assert cancelled == [True]
    assert sample(metrics, "omni_dp_router_client_disconnects_total") == 1


# --- retry -------------------------------------------------------------------------------------


def test_refused_connection_is_retried_once_on_another_replica(caplog):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin")) as served, \
                client() as session:
            await a.stop()  # healthy as far as the router knows, but the port now refuses
            await asyncio.sleep(0.05)
            status, headers, _body = await fetch(session, "POST", served.url + "/generate",
                                                data=b'{"x": 1}', headers={"X-Request-ID": "r1"})
            await served.wait_idle()
            return status, headers, b.seen, await scrape(session, served.url)

    status, headers, b_seen, metrics = run(main())
    assert status == 200
    assert headers["X-Omni-DP-Replica"] == "b"
    assert [s.body for s in b_seen] == [b'{"x": 1}']
    assert sample(metrics, "omni_dp_router_retries_total", reason="connect_error") == 1
    assert total(metrics, "omni_dp_router_retries_total") == 1
    assert sample(metrics, "omni_dp_router_upstream_errors_total",
                  replica="a", kind="connect_error") == 1
    routes = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "omni_dp.router.access"]
    (route,) = [r for r in routes if r["request_id"] == "r1"]
    assert route["attempts"] == 2
    assert route["replica"] == "b"
    assert route["status"] == 200


def test_retries_0_turns_a_refused_connection_into_502():
    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  retries=0)) as served, \
                client() as session:
            await a.stop()
            await asyncio.sleep(0.05)
            status, _, body = await fetch(session, "POST", served.url + "/generate")
            await served.wait_idle()
            return status, body, len(b.seen), await scrape(session, served.url)

    status, body, b_seen, metrics = run(main())
    assert status == 502
    assert error_body(body)["type"] == "connect_error"
    assert b_seen == 0
    assert total(metrics, "omni_dp_router_retries_total") == 0


class DropServer:
    """A replica that passes /health, but drops every other request after reading it."""

    def __init__(self) -> None:
        self.dropped = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> DropServer:
        self.server = await asyncio.start_server(self._connection, LOOPBACK, 0)
        return self

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _connection(self, reader, writer) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /health "):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\nok")
                await writer.drain()
            else:
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                self.dropped += 1
        finally:
            writer.close()


def test_request_dropped_before_the_status_line_is_retried_on_another_replica(caplog):
    """The replica read the request and closed without answering (kill -9 before it wrote a
    byte): nothing of the answer exists, so the request goes to another replica."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        dropper = await DropServer().start()
        try:
            async with backends("b") as (b,), \
                    serve(make_config([f"a={dropper.url}", f"b={b.url}"],
                                      policy="round_robin")) as served, client() as session:
                assert served.replica("a").routable
                status, headers, _ = await fetch(session, "POST", served.url + "/generate",
                                                 data=b'{"once": true}',
                                                 headers={"X-Request-ID": "dropped"})
                await served.wait_idle()
                return (status, headers, dropper.dropped, [s.body for s in b.seen],
                        served.replica("a").consecutive_failures,
                        await scrape(session, served.url))
        finally:
            await dropper.stop()

    status, headers, dropped, b_bodies, failures, metrics = run(main())
    assert status == 200
    assert headers["X-Omni-DP-Replica"] == "b"
    assert dropped == 1
    assert b_bodies == [b'{"once": true}']  # the same bytes, once
    assert failures == 1  # the drop still counts against a
    assert sample(metrics, "omni_dp_router_retries_total", reason="disconnected") == 1
    routes = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "omni_dp.router.access"]
    (route,) = [r for r in routes if r["request_id"] == "dropped"]
    assert (route["tried"], route["retries"], route["status"]) == (["a", "b"], ["disconnected"],
                                                                   200)


def test_a_retry_never_goes_back_to_a_replica_already_tried():
    """--retries 5 over two replicas that both drop every request: each is tried once (smg
    re-runs its policy blindly and was seen spending every attempt on one dead worker), nor
    while the request waits (--replica-wait) for a replica it has not tried: it waits that
    out and gets a 503."""

    async def main():
        droppers = [await DropServer().start() for _ in range(2)]
        try:
            urls = [f"{name}={d.url}" for name, d in zip("ab", droppers, strict=True)]
            async with serve(make_config(urls, retries=5, failures=100,
                                         replica_wait_s=0.3)) as served, \
                    client() as session:
                status, _, body = await fetch(session, "POST", served.url + "/generate",
                                              data=b"{}")
                await served.wait_idle()
                return status, body, [d.dropped for d in droppers], await scrape(
                    session, served.url)
        finally:
            for dropper in droppers:
                await dropper.stop()

    status, body, dropped, metrics = run(main())
    assert status == 503
    assert error_body(body)["type"] == "replica_wait_timeout"
    assert dropped == [1, 1]
    assert total(metrics, "omni_dp_router_retries_total") == 1
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="timed_out") == 1


def test_retries_0_sends_a_dropped_request_nowhere_else():
    async def main():
        dropper = await DropServer().start()
        try:
            async with backends("b") as (b,), \
                    serve(make_config([f"a={dropper.url}", f"b={b.url}"], policy="round_robin",
                                      retries=0)) as served, client() as session:
                status, _, body = await fetch(session, "POST", served.url + "/generate",
                                              data=b"{}")
                await served.wait_idle()
                return status, body, dropper.dropped, len(b.seen)
        finally:
            await dropper.stop()

    status, body, dropped, b_seen = run(main())
    assert status == 502
    assert error_body(body)["code"] == 502
    assert (dropped, b_seen) == (1, 0)


def test_response_timeout_is_a_502_and_is_not_retried(caplog):
    """--request-timeout: the request reached the replica, so it is never sent to another."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        a, b = Backend("a", hold_if_asked), Backend("b", hold_if_asked)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  request_timeout_s=0.3)) as served, client() as session:
            try:
                status, _, body = await fetch(session, "POST", served.url + "/generate?hold=1",
                                              data=b"{}", headers={"X-Request-ID": "slow"})
                await asyncio.sleep(0.4)  # a retry, had there been one, has reached b by now
            finally:
                a.release.set()
                b.release.set()
            await served.wait_idle()
            return status, body, len(a.seen), len(b.seen), await scrape(session, served.url)

    status, body, a_seen, b_seen, metrics = run(main())
    assert status == 502
    assert error_body(body)["type"] == "timeout"
    assert sorted([a_seen, b_seen]) == [0, 1]  # exactly one replica saw it, once
    assert total(metrics, "omni_dp_router_retries_total") == 0
    routes = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "omni_dp.router.access"]
    (route,) = [r for r in routes if r["request_id"] == "slow"]
    assert route["attempts"] == 1
    assert route["status"] == 502
    assert route["retries"] == []


def test_in_flight_returns_to_zero_after_a_mixed_load():
    """Successes, errors, streams, refused connections, drops, disconnects - all at once."""

    async def mixed(backend, request, seen):
        kind = request.query.get("kind", "ok")
        if kind == "error":
            return web.json_response({}, status=500)
        if kind in ("stream", "hangup"):
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(3):
                await resp.write(b"x" * 100)
                await asyncio.sleep(0.01)
            if kind == "hangup":
                await asyncio.sleep(30)  # the client leaves before this ends
            return resp
        if kind == "die":
            request.transport.close()
            return web.Response()
        return web.Response(body=b"ok")

    async def main():
        bs = [Backend(name, mixed, cancellation=True) for name in ("a", "b")]
        # "die" is dropped by both, then waits (--replica-wait) for a replica it has not tried
        async with backends(*bs), \
                serve(make_config([b.url for b in bs], failures=100,
                                  replica_wait_s=0.2)) as served, \
                client() as session:

            async def one(kind: str):
                url = served.url + f"/generate?kind={kind}"
                if kind == "hangup":
                    resp = await session.get(url)
                    await resp.content.readany()
                    resp.close()
                    return "closed"
                try:
                    return (await fetch(session, "GET", url))[0]
                except aiohttp.ClientPayloadError:
                    return "broken"

            kinds = ["ok", "error", "stream", "hangup", "die"] * 4
            results = await asyncio.gather(*(one(kind) for kind in kinds))
            await served.wait_idle()
            return dict(zip(kinds, results, strict=False)), results

    by_kind, results = run(main())
    assert by_kind["ok"] == 200
    assert by_kind["error"] == 500
    assert by_kind["stream"] == 200
    assert by_kind["die"] == 503
    assert results.count("closed") == 4


def blackhole(port: int) -> list[socket.socket]:
    """A listener on `port` whose accept queue is full: new SYNs go unanswered, as with a
    replica host that vanished. Returns the sockets to close."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, port))
    listener.listen(0)
    sockets = [listener]
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect((LOOPBACK, port))
        sockets.append(filler)
    return sockets


def test_connect_timeout_is_retried_on_another_replica():
    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  connect_timeout_s=0.3)) as served, client() as session:
            port = a.port
            await a.stop()
            held = blackhole(port)
            try:
                await asyncio.sleep(0.05)
                status, _headers, body = await fetch(session, "POST", served.url + "/generate",
                                                    data=b"{}")
            finally:
                for sock in held:
                    sock.close()
            await served.wait_idle()
            return status, body, len(b.seen), await scrape(session, served.url)

    status, body, b_seen, metrics = run(main())
    assert status == 200, body
    assert b_seen == 1
    assert sample(metrics, "omni_dp_router_retries_total", reason="connect_timeout") == 1


async def firehose(backend, request, seen):
    """Streams as fast as the connection takes it, until the router hangs up."""
    resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        for _ in range(100_000):
            await resp.write(b"\x01" * 4096)
    return resp


@pytest.mark.parametrize("loop", [
    "asyncio",
    "uvloop",
])
def test_clients_resetting_mid_stream_are_not_replica_failures(loop):
    if loop == "uvloop":
        pytest.importorskip("uvloop")

    async def main():
        backend = Backend("a", firehose, cancellation=True)
        async with backends(backend), \
                serve(make_config([f"a={backend.url}"], failures=3)) as served, \
                client() as session:
            port = int(served.url.rsplit(":", 1)[1])
            for _ in range(10):
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                writer.write(b"GET /v1/audio/speech HTTP/1.1\r\nHost: router\r\n\r\n")
                assert (await reader.read(65536)).startswith(b"HTTP/1.1 200")
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()  # RST: the client is gone
                await served.wait_idle()
            replica = served.replica("a")
            return (replica.num_ejections, replica.consecutive_failures,
                    await scrape(session, served.url))

    ejections, failures, metrics = run(main(), uvloop=loop == "uvloop")
    assert sample(metrics, "omni_dp_router_client_disconnects_total") == 10
    assert sample(metrics, "omni_dp_router_upstream_errors_total",
                  replica="a", kind="midstream") == 0
    assert (ejections, failures) == (0, 0)


def test_write_failing_with_a_reset_releases_each_slot_once(monkeypatch):
    """The client-reset path of the stream relay on the default loop too: uvloop reports a
    client gone mid-stream as ConnectionResetError from the write (asyncio as a cancel), so
    the write is made to fail that way here."""
    writes = {"n": 0}
    original = web.StreamResponse.write

    async def resetting_write(self, data):
        if "X-Omni-DP-Replica" in self.headers:  # only the relayed stream, not /metrics
            writes["n"] += 1
            if writes["n"] % 3 == 0:
                raise ConnectionResetError("Cannot write to closing transport")
        return await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", resetting_write)

    async def main():
        backend = Backend("a", firehose, cancellation=True)
        async with backends(backend), \
                serve(make_config([f"a={backend.url}"], failures=3)) as served, \
                client() as session:
            for _ in range(3):
                with contextlib.suppress(aiohttp.ClientError):
                    await fetch(session, "GET", served.url + "/v1/audio/speech")
                await served.wait_idle()
            replica = served.replica("a")
            return (replica.consecutive_failures, replica.lowest_in_flight,
                    served.router.lowest_admitted, await scrape(session, served.url))

    failures, lowest_in_flight, lowest_admitted, metrics = run(main())
    assert writes["n"] == 9
    assert sample(metrics, "omni_dp_router_client_disconnects_total") == 3
    assert sample(metrics, "omni_dp_router_upstream_errors_total",
                  replica="a", kind="midstream") == 0
    assert failures == 0
    assert (lowest_in_flight, lowest_admitted) == (0, 0)


# --- the request target and the route log ------------------------------------------------------


async def raw_exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """Send `request` on a fresh loopback connection; (status, body) of the answer."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # the request asks to close
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("target", [
    "http://{backend}/v1/models", "HTTP://router/health", "http://[::1]:9/x?y=1",
])
def test_absolute_form_request_target_gets_400_and_is_never_forwarded(target):
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url])) as served:
            line = target.format(backend=f"{LOOPBACK}:{backend.port}")
            status, body = await raw_exchange(
                int(served.url.rsplit(":", 1)[1]),
                f"GET {line} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n".encode())
            await served.wait_idle()
            return status, body, backend.seen

    status, body, seen = run(main())
    assert status == 400, body
    error = error_body(body)
    assert error["type"] == "invalid_request_target"
    assert "absolute URL" in error["message"]
    assert seen == []


def test_route_log_outcome_is_not_ok_for_replica_error_statuses(caplog):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        async with backends(Backend("a", status_from_query)) as (backend,), \
                serve(make_config([backend.url], failures=100)) as served, client() as session:
            for status in (200, 201, 404, 429, 500, 503):
                got, _, _ = await fetch(session, "POST", served.url + f"/generate?status={status}",
                                        headers={"X-Request-ID": f"r{status}"})
                assert got == status
            await served.wait_idle()

    run(main())
    routes = {r["request_id"]: r for r in (json.loads(rec.getMessage()) for rec in caplog.records
                                           if rec.name == "omni_dp.router.access")}
    outcomes = {rid: (route["status"], route["outcome"]) for rid, route in routes.items()}
    assert outcomes == {"r200": (200, "ok"), "r201": (201, "ok"), "r404": (404, "replica_4xx"),
                        "r429": (429, "replica_4xx"), "r500": (500, "replica_5xx"),
                        "r503": (503, "replica_5xx")}
