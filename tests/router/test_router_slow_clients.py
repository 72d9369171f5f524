"""Slow and stalled clients over raw loopback sockets: they must never hold the in-flight slots
that real requests need, and every stall is bounded (body timeout, header timeout, 413 at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import web

from support.http_client import client, fetch
from support.ports import LOOPBACK
from support.router import (
    Backend,
    backends,
    error_body,
    make_config,
    run,
    sample,
    scrape,
    serve,
)
from support.wait import until

SPEECH_HEAD = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: router\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n")


def counting_middleware(counter: list[int]):
    """Counts the requests whose handler the router started (their headers were read)."""

    @web.middleware
    async def count(request, handler):
        counter[0] += 1
        return await handler(request)

    return count


class RawClient:
    """One raw TCP client of the router: sends exactly the bytes it is given, when told."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(LOOPBACK, self.port)
        return self

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 5.0) -> tuple[int, bytes]:
        """(status, body) of the answer, read until the router closes or the body is in."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@contextlib.asynccontextmanager
async def raw_clients(port: int, count: int):
    clients = [RawClient(port) for _ in range(count)]
    try:
        for raw in clients:
            await raw.open()
        yield clients
    finally:
        for raw in clients:
            raw.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_stalled_body_senders_do_not_lock_out_real_requests():
    """8 clients send their headers and a few body bytes, then stall, on a --max-inflight 8
    router: real requests are still served (before: every one got 503 router_full)."""

    async def main():
        started = [0]
        async with backends("a") as (backend,), \
                serve(make_config([f"a={backend.url}"], max_inflight=8),
                      middlewares=(counting_middleware(started),)) as served, \
                raw_clients(port_of(served.url), 8) as stalled, client() as session:
            for raw in stalled:
                await raw.send(SPEECH_HEAD % 100 + b'{"input": "sl')
            await until(lambda: started[0] == 8, what="8 stalled requests started")
            real = [await fetch(session, "POST", served.url + "/v1/audio/speech",
                                data=b'{"input": "real"}') for _ in range(20)]
            holding = served.router.num_admitted, len(backend.seen)
        return [status for status, _, _ in real], holding

    statuses, (admitted, seen) = run(main())
    assert statuses == [200] * 20
    assert admitted == 0  # the stalled ones hold no in-flight slot
    assert seen == 20  # and none of them reached the replica


def test_trickled_body_is_served_when_it_completes_in_time():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], max_inflight=1, body_timeout_s=10)) \
                as served, \
                raw_clients(port_of(served.url), 1) as (raw,), client() as session:
            body = b'{"input": "trickled"}'
            await raw.send(SPEECH_HEAD % len(body))
            for index, byte in enumerate(body):
                await raw.send(bytes([byte]))
                if index == 3:  # mid-trickle, the single in-flight slot is still free
                    real = await fetch(session, "GET", served.url + "/v1/models")
                await asyncio.sleep(0.01)
            status, _ = await raw.response()
            await served.wait_idle()
            return real[0], status, [(s.method, s.body) for s in backend.seen]

    real, status, seen = run(main())
    assert real == 200
    assert status == 200
    assert seen == [("GET", b""), ("POST", b'{"input": "trickled"}')]


def test_a_body_that_does_not_arrive_in_time_gets_408_and_frees_its_reader_slot():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], body_timeout_s=0.3)) as served, \
                raw_clients(port_of(served.url), 2) as (stalled, trickler):
            await stalled.send(SPEECH_HEAD % 100 + b'{"in')
            await trickler.send(SPEECH_HEAD % 100)

            async def trickle():  # keeps sending, too slowly: the timeout is for the whole body
                with contextlib.suppress(ConnectionError):
                    for _ in range(40):
                        await trickler.send(b" ")
                        await asyncio.sleep(0.05)

            trickling = asyncio.create_task(trickle())
            answers = [await stalled.response(), await trickler.response()]
            trickling.cancel()
            await served.wait_idle()
            return answers, served.router.num_reading, len(backend.seen)

    answers, reading, seen = run(main())
    for status, body in answers:
        assert status == 408
        error = error_body(body)
        assert error["type"] == "body_timeout" and "--body-timeout" in error["message"]
    assert reading == 0
    assert seen == 0


def test_too_many_body_readers_get_503_and_bodiless_requests_still_pass():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], max_body_readers=2)) as served, \
                raw_clients(port_of(served.url), 2) as stalled, client() as session:
            for raw in stalled:
                await raw.send(SPEECH_HEAD % 100)
            await until(lambda: served.router.num_reading == 2, what="2 readers")
            refused = await fetch(session, "POST", served.url + "/v1/audio/speech",
                                  data=b'{"input": "x"}')
            bodiless, _, _ = await fetch(session, "GET", served.url + "/v1/models")
            metrics = await scrape(session, served.url)
            return refused, bodiless, metrics

    (status, headers, body), bodiless, metrics = run(main())
    assert status == 503 and headers["Retry-After"] == "1"
    assert error_body(body)["type"] == "readers_full"
    assert bodiless == 200
    assert sample(metrics, "omni_dp_router_admission_rejections_total",
                  reason="readers_full") == 1


def test_content_length_over_the_limit_gets_413_before_any_body_byte():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], max_body_bytes=1024)) as served, \
                raw_clients(port_of(served.url), 2) as (speech, admin):
            await speech.send(SPEECH_HEAD % 10**9)  # headers only: no body byte follows
            await admin.send(b"POST /workers HTTP/1.1\r\nHost: router\r\n"
                             b"Content-Length: 2048\r\n\r\n")
            answers = [await speech.response(), await admin.response()]
            return answers, len(backend.seen), [r.id for r in served.router.replicas]

    answers, seen, ids = run(main())
    for status, body in answers:
        assert status == 413
        error = error_body(body)
        assert error["type"] == "body_too_large" and "--max-body-bytes" in error["message"]
    assert json.loads(answers[0][1])["error"]["message"].startswith("Content-Length 1000000000")
    assert seen == 0
    assert ids == ["0"]


def test_a_client_that_never_finishes_its_headers_is_disconnected():
    async def main():
        async with backends("a") as (backend,), \
                serve(make_config([backend.url], header_timeout_s=0.3)) as served, \
                raw_clients(port_of(served.url), 2) as (slowloris, idle), client() as session:
            await slowloris.send(b"GET /v1/models HTTP/1.1\r\nHost: router\r\nX-Slow: ")
            for _ in range(3):
                ok, _, _ = await fetch(session, "GET", served.url + "/v1/models")
                assert ok == 200
            # the router closes both: the unfinished head, and the one that sent nothing
            closed = [await asyncio.wait_for(raw.reader.read(), 5) for raw in (slowloris, idle)]
            return closed, len(backend.seen)

    closed, seen = run(main())
    assert closed == [b"", b""]
    assert seen == 3


def test_the_header_timeout_does_not_cut_a_long_response():
    """aiohttp's keep-alive timer only closes connections waiting for a request head."""

    async def slow(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await resp.prepare(request)
        for _ in range(8):
            await resp.write(b"x" * 10)
            await asyncio.sleep(0.1)
        return resp

    async def main():
        async with backends(Backend("a", slow)) as (backend,), \
                serve(make_config([backend.url], header_timeout_s=0.2)) as served, \
                client() as session:
            return await fetch(session, "GET", served.url + "/v1/audio/speech")

    status, _, body = run(main())
    assert (status, body) == (200, b"x" * 80)


def test_a_client_hanging_up_mid_body_is_a_quiet_disconnect(caplog):
    caplog.set_level(logging.INFO)

    async def main():
        async with backends("a") as (backend,), serve(make_config([backend.url])) as served, \
                raw_clients(port_of(served.url), 1) as (raw,):
            await raw.send(SPEECH_HEAD % 100 + b'{"in')
            await until(lambda: served.router.num_reading == 1, what="1 reader")
            raw.close()
            await until(lambda: served.router.num_reading == 0, what="the reader gone")
            await served.wait_idle()
            return len(backend.seen)

    assert run(main()) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    (route,) = [json.loads(r.getMessage()) for r in caplog.records
                if r.name == "omni_dp.router.access"]
    assert route["outcome"] == "client_disconnected"
