"""Retry before the first byte: a request none of whose answer reached the client goes to
another replica (one it was not sent to), counted by reason; once a byte went out it never
does (short of a resume, test_router_resume.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from support.http_client import client, fetch
from support.router import (
    Backend,
    backends,
    error_body,
    hold_if_asked,
    make_config,
    read_all,
    routes,
    run,
    sample,
    scrape,
    serve,
    total,
)
from support.wait import until


async def going_away(backend, request, seen):
    """A replica that is draining: 503 marked going away, as `omni-dp serve` answers then."""
    return web.json_response({"error": {"message": "replica is draining"}}, status=503,
                             headers={"X-Omni-DP-Going-Away": "draining", "Retry-After": "1"})


async def full(backend, request, seen):
    """A replica that is full: a 503 that says nothing of going away."""
    return web.json_response({"error": {"message": "replica is full"}}, status=503,
                             headers={"Retry-After": "1"})


def test_a_5xx_from_a_replica_going_away_is_sent_to_another_replica(caplog):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        a, b = Backend("a", going_away), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=1)) as served, client() as session:
            status, headers, _ = await fetch(session, "POST", served.url + "/v1/audio/speech",
                                             data=b"{}", headers={"X-Request-ID": "away"})
            await served.wait_idle()
            return (status, headers, len(a.seen), len(b.seen), served.replica("a").routable,
                    await scrape(session, served.url))

    status, headers, a_seen, b_seen, a_routable, metrics = run(main())
    assert status == 200
    assert headers["X-Omni-DP-Replica"] == "b"
    assert (a_seen, b_seen) == (1, 1)
    assert a_routable  # going away is no failure of its own
    assert sample(metrics, "omni_dp_router_retries_total", reason="going_away") == 1
    assert routes(caplog)["away"]["retries"] == ["going_away"]


def test_a_503_that_does_not_say_going_away_is_relayed_as_it_is():
    async def main():
        a, b = Backend("a", full), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"],
                                  policy="round_robin")) as served, client() as session:
            status, headers, body = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            return status, headers, body, len(b.seen), await scrape(session, served.url)

    status, headers, body, b_seen, metrics = run(main())
    assert status == 503
    assert headers["X-Omni-DP-Replica"] == "a"
    assert b"full" in body
    assert b_seen == 0
    assert total(metrics, "omni_dp_router_retries_total") == 0


def test_a_going_away_answer_with_no_replica_left_is_relayed_as_it_is():
    """--replica-wait 0: no other replica now, and none waited for."""

    async def main():
        a = Backend("a", going_away)
        async with backends(a), serve(make_config([f"a={a.url}"], replica_wait_s=0)) as served, \
                client() as session:
            status, headers, body = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            return status, headers, body

    status, headers, body = run(main())
    assert status == 503
    assert headers["X-Omni-DP-Going-Away"] == "draining"
    assert b"draining" in body


async def dies_after_head(backend, request, seen):
    """The status line and headers, then the connection drops before any body byte."""
    response = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
    await response.prepare(request)
    await asyncio.sleep(0.05)
    request.transport.abort()
    return response


async def dies_mid_whole_body(backend, request, seen):
    """A small body of known length, cut after half of it: the router reads such a body
    whole before it sends anything, so nothing reached the client."""
    response = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
    response.content_length = 1000
    await response.prepare(request)
    await response.write(b"x" * 500)
    await asyncio.sleep(0.05)
    request.transport.abort()
    return response


async def streams_whole(backend, request, seen):
    response = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
    await response.prepare(request)
    for _ in range(3):
        await response.write(b"y" * 100)
    await response.write_eof()
    return response


@pytest.mark.parametrize("dying", [dies_after_head, dies_mid_whole_body],
                         ids=["after-its-head", "mid-body-read-whole"])
def test_a_replica_dying_before_the_client_got_a_byte_is_retried(dying):
    """The router sends an answer's head with its first body byte: a replica that dies after
    its head but before that byte has sent the client nothing, and the request goes on."""

    async def main():
        a, b = Backend("a", dying), Backend("b", streams_whole)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"],
                                  policy="round_robin")) as served, client() as session:
            status, headers, body = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            return status, headers, body, await scrape(session, served.url)

    status, headers, body, metrics = run(main())
    assert status == 200
    assert headers["X-Omni-DP-Replica"] == "b"
    assert body == b"y" * 300
    assert sample(metrics, "omni_dp_router_retries_total", reason="midstream") == 1


async def one_byte_then_dies(backend, request, seen):
    response = web.StreamResponse(headers={"Content-Type": "audio/ogg"})
    await response.prepare(request)
    await response.write(b"O")
    await asyncio.sleep(0.05)
    request.transport.abort()
    return response


def test_a_stream_cut_after_its_first_byte_is_never_sent_again():
    """Not resumable (no X-Omni-DP-Resumable): one byte out, then the cut is the client's."""

    async def main():
        a, b = Backend("a", one_byte_then_dies), Backend("b", streams_whole)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"],
                                  policy="round_robin")) as served, client() as session:
            _, _, got, broken = await read_all(session, served.url + "/x", data=b"{}")
            await served.wait_idle()
            return got, broken, len(b.seen), await scrape(session, served.url)

    got, broken, b_seen, metrics = run(main())
    assert got == b"O"
    assert broken is not None  # no terminating chunk: never a short success
    assert b_seen == 0
    assert total(metrics, "omni_dp_router_retries_total") == 0
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="not_resumable") == 1


def test_the_deadline_bounds_the_retries():
    """--request-timeout is the request's, across its attempts: a retry whose time is spent is
    not made."""

    async def slow_then_drop(backend, request, seen):
        await asyncio.sleep(0.4)
        request.transport.abort()
        return web.Response()

    async def main():
        a, b = Backend("a", slow_then_drop), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  request_timeout_s=0.3)) as served, client() as session:
            status, _, body = await fetch(session, "POST", served.url + "/x", data=b"{}")
            await served.wait_idle()
            return status, body, len(b.seen)

    status, body, b_seen = run(main())
    assert status == 502
    assert error_body(body)["type"] == "timeout"
    assert b_seen == 0


async def drops_its_first(backend, request, seen):
    """Its first request is dropped before the status line (a kill -9); then it answers, as a
    replica restarted by its supervisor does."""
    if len(backend.seen) == 1:
        request.transport.abort()
        return web.Response()
    return web.json_response({"backend": backend.name})


def restart(served, replica_id: str) -> None:
    """What the supervisor does around a replica's restart (PUT /workers/ID twice)."""
    replica = served.replica(replica_id)
    served.router.set_disabled(replica, True)
    served.router.set_disabled(replica, False)


def test_a_replica_restarted_while_the_retry_was_elsewhere_may_take_the_request_again(caplog):
    """a drops the request; while its retry is on b, a is restarted (a new process); b drops
    it too: the second retry goes to a, which this request tried before it restarted."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def holds_then_drops(backend, request, seen):
        await backend.release.wait()
        request.transport.abort()
        return web.Response()

    async def main():
        a, b = Backend("a", drops_its_first), Backend("b", holds_then_drops)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, retries=2)) as served, client() as session:
            asking = asyncio.create_task(fetch(session, "POST", served.url + "/x", data=b"{}",
                                               headers={"X-Request-ID": "gen"}))
            await until(lambda: len(b.seen) == 1, 3, "the retry on b")
            restart(served, "a")
            b.release.set()
            status, headers, _ = await asyncio.wait_for(asking, 3)
            await served.wait_idle()
            return status, headers, served.replica("a").generation

    status, headers, generation = run(main())
    assert (status, headers["X-Omni-DP-Replica"]) == (200, "a")
    assert generation == 2  # its first check, then the enable
    route = routes(caplog)["gen"]
    assert (route["tried"], route["retries"]) == (["a", "b", "a"], ["disconnected"] * 2)


# --- waiting for a replica to go to (--replica-wait) -----------------------------------------


async def wait_for_a_waiter(served) -> None:
    await until(lambda: served.router.num_waiting == 1, 3, "the request waiting for a replica")


def test_a_retry_whose_only_other_replica_is_restarting_waits_for_it(caplog):
    """a drops the request; b is disabled (its supervisor restarts it): the retry waits for b
    instead of a 502 at once, and b answers it once enabled."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        a, b = Backend("a", drops_its_first), Backend("b")
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], failures=100,
                                  replica_wait_s=10)) as served, client() as session:
            served.router.set_disabled(served.replica("b"), True)
            asking = asyncio.create_task(fetch(session, "POST", served.url + "/x", data=b"{}",
                                               headers={"X-Request-ID": "retry"}))
            await wait_for_a_waiter(served)
            served.router.set_disabled(served.replica("b"), False)
            status, headers, _ = await asyncio.wait_for(asking, 3)
            await served.wait_idle()
            return status, headers, await scrape(session, served.url)

    status, headers, metrics = run(main())
    assert (status, headers["X-Omni-DP-Replica"]) == (200, "b")
    assert sample(metrics, "omni_dp_router_retries_total", reason="disconnected") == 1
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="found") == 1
    route = routes(caplog)["retry"]
    assert (route["tried"], route["retries"]) == (["a", "b"], ["disconnected"])
    assert route["waited_s"] > 0


def test_a_replica_restarted_since_a_request_tried_it_may_take_it_again(caplog):
    """The request's only replica drops it, and is restarted (disabled, enabled): a new
    process, which the request has not tried. It goes there again, and is answered."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        a = Backend("a", drops_its_first)
        async with backends(a), \
                serve(make_config([f"a={a.url}"], failures=100,
                                  replica_wait_s=2)) as served, client() as session:
            asking = asyncio.create_task(fetch(session, "POST", served.url + "/x", data=b"{}",
                                               headers={"X-Request-ID": "again"}))
            await wait_for_a_waiter(served)  # tried a: nowhere to go until a restarts
            restart(served, "a")
            status, _, _ = await asyncio.wait_for(asking, 3)
            await served.wait_idle()
            return status, len(a.seen), served.replica("a").describe()

    status, a_seen, described = run(main())
    assert status == 200
    assert a_seen == 2
    assert described["generation"] == 2  # its first check, then the enable
    assert routes(caplog)["again"]["tried"] == ["a", "a"]


def test_a_double_fault_is_survived_with_the_default_retries():
    """Both replicas die under one request, a few seconds apart (the first one it went to,
    then the one its retry went to): the default --retries leaves the request a third try,
    which waits for the first one's restart and is answered there."""

    async def main():
        a, b = Backend("a", drops_its_first), Backend("b", drops_its_first)
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=100, replica_wait_s=10)) as served, \
                client() as session:
            asking = asyncio.create_task(fetch(session, "POST", served.url + "/x", data=b"{}"))
            await wait_for_a_waiter(served)  # both tried
            restart(served, "a")
            status, headers, _ = await asyncio.wait_for(asking, 3)
            await served.wait_idle()
            return status, headers, [len(a.seen), len(b.seen)], await scrape(session,
                                                                              served.url)

    status, headers, seen, metrics = run(main())
    assert (status, headers["X-Omni-DP-Replica"]) == (200, "a")
    assert seen == [2, 1]
    assert sample(metrics, "omni_dp_router_retries_total", reason="disconnected") == 2


def test_a_retry_whose_only_other_replica_is_at_its_cap_waits_for_a_slot():
    """--max-inflight-per-replica 1: b holds a request when a drops another; the retry waits
    for b's slot (given back when b's request ends) instead of a 502 at once."""

    async def main():
        a, b = Backend("a", drops_its_first), Backend("b", hold_if_asked)
        async with backends(a, b), \
                serve(make_config([f"b={b.url}", f"a={a.url}"], policy="round_robin",
                                  failures=100, max_inflight_per_replica=1,
                                  replica_wait_s=10)) as served, client() as session:
            held = asyncio.create_task(fetch(session, "POST", served.url + "/x?hold=1"))
            await until(lambda: len(b.seen) == 1, 3, "b holding a request")
            retried = asyncio.create_task(fetch(session, "POST", served.url + "/x"))
            await wait_for_a_waiter(served)  # a dropped it, b is full
            b.release.set()
            answers = await asyncio.wait_for(asyncio.gather(held, retried), 3)
            await served.wait_idle()
            return [(status, headers["X-Omni-DP-Replica"]) for status, headers, _ in answers]

    assert run(main()) == [(200, "b"), (200, "b")]
