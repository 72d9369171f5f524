"""Hung replicas: one that takes a request and answers nothing in time (--first-byte-timeout,
--stall-timeout), nor its /health check, is ejected at once as hung, reported in GET /workers
and /metrics, and its requests go elsewhere; one that is only slow is waited on."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from support.http_client import client, fetch
from support.router import (
    Backend,
    backends,
    make_config,
    read_all,
    run,
    sample,
    scrape,
    serve,
    total,
)

# Short enough for a quick test; the check of a late replica may take min(0.3, T / 2).
TIMEOUTS = {"first_byte_timeout_s": 0.6, "stall_timeout_s": 0.6, "health_timeout": 0.3}


@dataclass(eq=False)
class Hangable(Backend):
    """A stand-in that stops answering anything, /health included, once `hung` is set: what a
    SIGSTOPped replica looks like from outside (the kernel still accepts connections)."""

    hung: bool = False

    async def _health(self, request: web.Request) -> web.Response:
        if self.hung:
            await asyncio.Event().wait()  # until the server is stopped
        return await super()._health(request)


async def hang_when_asked(backend: Hangable, request: web.Request, seen) -> web.Response:
    if backend.hung:
        await asyncio.Event().wait()
    return web.json_response({"backend": backend.name})


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    status, _, body = await fetch(session, "GET", url + "/workers")
    assert status == 200
    return {w["id"]: w for w in json.loads(body)["workers"]}


def test_a_replica_that_answers_nothing_is_ejected_as_hung_and_its_requests_go_on():
    async def main():
        a, b = Hangable("a", hang_when_asked), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, **TIMEOUTS)) as served, client() as session:
            a.hung = True
            # two requests waiting on a when its check fails: both are let go, and go to b
            results = await asyncio.gather(*(
                fetch(session, "POST", served.url + "/v1/audio/speech", data=b"{}")
                for _ in range(4)))
            await served.wait_idle()
            listed = await workers(session, served.url)
            return results, listed, len(a.seen), len(b.seen), await scrape(session, served.url)

    results, listed, a_seen, b_seen, metrics = run(main())
    assert [status for status, _, _ in results] == [200] * 4
    assert {headers["X-Omni-DP-Replica"] for _, headers, _ in results} == {"b"}
    assert a_seen == 2  # round robin sent it two before it was found hung
    assert b_seen == 4
    hung = listed["a"]
    assert (hung["health"], hung["routable"], hung["ejected_reason"]) == ("unhealthy", False,
                                                                          "hang")
    assert hung["hangs"] == 1 and hung["ejections"] == 1 and hung["ejected_at"] > 0
    assert "no status line within 0.6 s" in hung["last_error"]
    assert listed["b"]["ejected_reason"] is None
    assert sample(metrics, "omni_dp_router_hangs_total", replica="a") == 1
    assert sample(metrics, "omni_dp_router_retries_total", reason="first_byte_timeout") == 2


def test_a_slow_replica_that_passes_its_check_is_waited_on():
    async def slow(backend, request, seen):
        await asyncio.sleep(1.5)  # past the first-byte timeout, twice
        return web.json_response({"backend": backend.name})

    async def main():
        a, b = Backend("a", slow), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  **TIMEOUTS)) as served, client() as session:
            probes_before = a.health_probes
            status, headers, _ = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            listed = await workers(session, served.url)
            return (status, headers, a.health_probes - probes_before, len(b.seen), listed,
                    await scrape(session, served.url))

    status, headers, checks, b_seen, listed, metrics = run(main())
    assert status == 200
    assert headers["X-Omni-DP-Replica"] == "a"
    assert checks >= 2  # checked as it ran late, and found alive each time
    assert b_seen == 0
    assert listed["a"]["routable"] and listed["a"]["ejected_reason"] is None
    assert total(metrics, "omni_dp_router_hangs_total") == 0


def stalls_after(num_bytes: int, resumable: bool):
    """Streams `num_bytes`, then stops answering anything (its /health too)."""

    async def handler(backend: Hangable, request: web.Request, seen) -> web.StreamResponse:
        offset = int(request.headers.get("X-Omni-DP-Resume-From", "0"))
        headers = {"Content-Type": "audio/pcm"}
        if resumable:
            headers.update({"X-Seed": "5", "X-Omni-DP-Resumable": "bytes"})
            if "X-Omni-DP-Resume-From" in request.headers:
                headers["X-Omni-DP-Resumed-From"] = str(offset)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        data = bytes(range(256)) * 400
        end = len(data) if backend.name == "b" else num_bytes
        await response.write(data[offset:end])
        if backend.name != "b":
            backend.hung = True
            await asyncio.Event().wait()
        await response.write_eof()
        return response

    return handler


def test_a_stream_that_stalls_on_a_hung_replica_is_resumed_elsewhere():
    async def main():
        handler = stalls_after(30_000, resumable=True)
        a, b = Hangable("a", handler), Hangable("b", handler)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, **TIMEOUTS)) as served, client() as session:
            status, _, body = await fetch(session, "POST", served.url + "/v1/audio/speech",
                                          data=b"{}")
            await served.wait_idle()
            listed = await workers(session, served.url)
            return status, body, listed, await scrape(session, served.url)

    status, body, listed, metrics = run(main())
    assert status == 200
    assert body == bytes(range(256)) * 400
    assert listed["a"]["ejected_reason"] == "hang"
    assert "no byte within 0.6 s" in listed["a"]["last_error"]
    assert sample(metrics, "omni_dp_router_resumes_total", reason="stall_timeout") == 1


def test_a_stream_that_stalls_and_cannot_be_resumed_ends_cut():
    async def main():
        handler = stalls_after(30_000, resumable=False)
        a, b = Hangable("a", handler), Hangable("b", handler)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, **TIMEOUTS)) as served, client() as session:
            _, _, got, broken = await read_all(session, served.url + "/x", data=b"{}")
            await served.wait_idle()
            return got, broken, len(b.seen), await scrape(session, served.url)

    got, broken, b_seen, metrics = run(main())
    assert got == (bytes(range(256)) * 400)[:30_000]
    assert broken is not None
    assert b_seen == 0
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="not_resumable") == 1
    assert sample(metrics, "omni_dp_router_hangs_total", replica="a") == 1


def test_a_hung_replica_that_recovers_is_readmitted_and_no_longer_reported():
    async def main():
        a, b = Hangable("a", hang_when_asked), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, interval=0.1, successes=2,
                                  **TIMEOUTS)) as served, client() as session:
            a.hung = True
            status, _, _ = await fetch(session, "POST", served.url + "/x", data=b"{}")
            assert (await workers(session, served.url))["a"]["ejected_reason"] == "hang"
            a.hung = False  # SIGCONT
            for _ in range(100):
                if served.replica("a").routable:
                    break
                await asyncio.sleep(0.05)
            await served.wait_idle()
            return status, await workers(session, served.url)

    status, listed = run(main())
    assert status == 200
    assert listed["a"]["routable"]
    assert listed["a"]["ejected_reason"] is None and listed["a"]["ejected_at"] is None
    assert listed["a"]["hangs"] == 1  # the count stays
