"""Hung replicas: one that takes a request and answers nothing in time (--first-byte-timeout,
--stall-timeout), nor its /health check, is ejected at once as hung, reported in GET /workers
and /metrics, and its requests go elsewhere; one that is only slow is waited on."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from omni_dp.router.hangs import HangTimeout, HangWatch
from omni_dp.router.health import record_hang
from omni_dp.router.replicas import Health, Replica

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
from support.virtual_clock import run_virtual

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


# --- when a silent replica is let go: on a virtual clock, exactly ----------------------------
# T = 1 s; the check may take c = min(--health-timeout, T / 2): 0.3, 0.5 and 0.5 s here. A
# router that checked only at T would let go at T + c (1.3, 1.5, 1.5 s); one that gave the
# check the whole --health-timeout, at T - c + that (1.0, 1.01, 2.5 s).
HEALTH_TIMEOUTS = [0.3, 0.51, 2.0]


def silent_replica() -> tuple[Replica, list[tuple[float, float]]]:
    """A healthy replica record, and the (loop time, budget) of each check of it."""
    replica = Replica("a", "http://127.0.0.1:1")
    replica.health = Health.HEALTHY
    return replica, []


def silent_check(checks: list[tuple[float, float]]):
    """The health check of a replica that answers nothing: it runs out its whole budget."""

    async def check(replica: Replica, seconds: float) -> tuple[bool, str]:
        checks.append((asyncio.get_running_loop().time(), seconds))
        await asyncio.sleep(seconds)
        return False, f"/health did not answer within {seconds:g} s"

    return check


@pytest.mark.parametrize("health_timeout", HEALTH_TIMEOUTS)
def test_a_request_on_a_silent_replica_is_let_go_by_its_timeout_check_included(health_timeout):
    """Waiting for a status line that never comes: let go at T, the check's verdict in by
    then (loop time on a virtual clock: exact, however loaded the machine)."""
    timeout_s = 1.0
    replica, checks = silent_replica()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        watch = HangWatch(silent_check(checks), health_timeout, record_hang)
        began = loop.time()
        with pytest.raises(HangTimeout):
            await watch.wait(replica, timeout_s, loop.create_future(), "status line")
        return loop.time() - began

    let_go = run_virtual(main())
    check_s = min(health_timeout, timeout_s / 2)
    assert let_go == pytest.approx(timeout_s)
    assert checks == [(pytest.approx(timeout_s - check_s), pytest.approx(check_s))]
    assert replica.ejected_reason == "hang" and replica.num_hangs == 1


@pytest.mark.parametrize("health_timeout", HEALTH_TIMEOUTS)
def test_a_stream_that_goes_silent_is_cut_by_its_last_byte_plus_its_timeout(health_timeout):
    """Bytes at 0.25 and 0.6 s, then nothing: the stream is cut at 0.6 + T, not before (it
    was flowing) and not after (the check ran early enough)."""
    timeout_s = 1.0
    replica, checks = silent_replica()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        watch = HangWatch(silent_check(checks), health_timeout, record_hang)
        cut = loop.create_future()
        with watch.watch(replica, timeout_s, "byte", lambda: cut.set_result(loop.time())) \
                as stream:
            for at in (0.25, 0.6):
                await asyncio.sleep(at - loop.time())
                stream.touch(loop.time())
            cut_at = await cut
            assert stream.expired
        return cut_at

    cut_at = run_virtual(main())
    assert cut_at == pytest.approx(0.6 + timeout_s)
    assert len(checks) == 1 and replica.num_hangs == 1


def test_the_routers_check_of_a_late_replica_has_the_time_left_before_t_not_its_own():
    """Through the router: --health-timeout (5 s) is longer than the time left for the check
    of a replica late by its first-byte timeout T (0.6 s): the check it runs is given
    T / 2 = 0.3 s, as its verdict says (no wall-clock bound: the budget is what is asserted)."""

    async def main():
        a, b = Hangable("a", hang_when_asked), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, first_byte_timeout_s=0.6,
                                  health_timeout=5.0)) as served, client() as session:
            a.hung = True
            status, headers, _ = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            return status, headers, await workers(session, served.url)

    status, headers, listed = run(main())
    assert (status, headers["X-Omni-DP-Replica"]) == (200, "b")
    assert listed["a"]["ejected_reason"] == "hang"
    assert "/health did not answer within 0.3 s" in listed["a"]["last_error"]


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


def test_a_replica_removed_and_added_again_counts_its_hangs_from_zero():
    """The same id added again is a new replica: its hangs (and ejections) start from 0, and
    a hang of the new one counts 1, not the old one's count plus 1."""

    async def hang_once(served, session, a: Hangable) -> None:
        """Requests until one went to `a`, hung: it is found so and its request goes to b."""
        a.hung, before = True, len(a.seen)
        for _ in range(2):
            status, _, _ = await fetch(session, "POST", served.url + "/x", data=b"{}")
            assert status == 200
            if len(a.seen) > before:
                break
        await served.wait_idle()

    async def main():
        a, b = Hangable("a", hang_when_asked), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, **TIMEOUTS)) as served, client() as session:
            await hang_once(served, session, a)
            old = (await workers(session, served.url))["a"]
            status, _, _ = await fetch(session, "DELETE", served.url + "/workers/a")
            assert status == 200
            a.hung = False
            status, _, body = await fetch(session, "POST", served.url + "/workers",
                                          json={"url": a.url, "id": "a"})
            assert status == 201, body
            added = (await workers(session, served.url))["a"], await scrape(session, served.url)
            await hang_once(served, session, a)
            hung_again = (await workers(session, served.url))["a"], await scrape(session,
                                                                                  served.url)
            return old, added, hung_again

    old, (added, added_metrics), (again, again_metrics) = run(main())
    assert (old["hangs"], old["ejections"]) == (1, 1)
    assert (added["hangs"], added["ejections"], added["routable"]) == (0, 0, True)
    assert sample(added_metrics, "omni_dp_router_hangs_total", replica="a") == 0
    assert sample(added_metrics, "omni_dp_router_ejections_total", replica="a") == 0
    assert (again["hangs"], again["ejections"]) == (1, 1)
    assert sample(again_metrics, "omni_dp_router_hangs_total", replica="a") == 1
    assert sample(again_metrics, "omni_dp_router_ejections_total", replica="a") == 1
