"""A request that finds no routable replica waits for one (--replica-wait) instead of a 503 at
once: a replica's restart (disabled, restarted, enabled by its supervisor) costs latency, not
requests. The wait is bounded by --replica-wait and the request's deadline, held in its
in-flight slot, and ended at once by a router that begins stopping; --replica-wait 0 is the
503 at once. (Retries and resumes that wait: test_router_retry.py, test_router_resume.py; the
speech session: test_router_speech_stream.py.)"""

from __future__ import annotations

import asyncio
import logging
import time

from support.http_client import client, fetch
from support.router import (
    backends,
    error_body,
    make_config,
    routes,
    run,
    sample,
    scrape,
    serve,
    total,
)
from support.wait import until


async def set_disabled(session, served, replica_id: str, disabled: bool) -> None:
    """What the supervisor does around a replica's restart: PUT /workers/ID."""
    status, _, body = await fetch(session, "PUT", f"{served.url}/workers/{replica_id}",
                                  json={"disabled": disabled})
    assert status == 200, body


async def waiting(served, count: int = 1) -> None:
    """Until `count` requests wait for a replica (a short wait: they are admitted at once)."""
    await until(lambda: served.router.num_waiting == count, 3,
                f"{count} request(s) waiting for a replica")


async def timed(coro) -> tuple[float, tuple]:
    """(seconds it took, what it returned); bounded, so a wait that does not end fails."""
    started = time.monotonic()
    result = await asyncio.wait_for(coro, 3)
    return time.monotonic() - started, result


def speech(session, served, request_id: str):
    return fetch(session, "POST", served.url + "/v1/audio/speech", data=b'{"input": "x"}',
                 headers={"X-Request-ID": request_id})


def test_requests_with_no_routable_replica_wait_and_are_answered_once_one_is_enabled(caplog):
    """Five requests arrive while the only replica is disabled (restarting): each waits in its
    in-flight slot, and the one enable wakes them all; none is refused."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=10)) as served, \
                client() as session:
            await set_disabled(session, served, "a", True)
            asking = [asyncio.create_task(speech(session, served, f"w{i}")) for i in range(5)]
            await waiting(served, 5)
            await asyncio.sleep(0.2)
            still_waiting = not any(task.done() for task in asking)
            admitted = served.router.num_admitted
            await set_disabled(session, served, "a", False)
            answers = await asyncio.wait_for(asyncio.gather(*asking), 3)
            await served.wait_idle()
            return still_waiting, admitted, answers, await scrape(session, served.url)

    still_waiting, admitted, answers, metrics = run(main())
    assert still_waiting and admitted == 5  # each in its in-flight slot
    assert [(status, headers["X-Omni-DP-Replica"]) for status, headers, _ in answers] == [
        (200, "a")] * 5
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="found") == 5
    assert sample(metrics, "omni_dp_router_replica_wait_seconds_count") == 5
    assert sample(metrics, "omni_dp_router_replica_wait_seconds_sum") >= 5 * 0.2
    assert total(metrics, "omni_dp_router_admission_rejections_total") == 0
    lines = routes(caplog)
    assert all(lines[f"w{i}"]["waited_s"] >= 0.2 for i in range(5)), lines
    assert all(lines[f"w{i}"]["outcome"] == "ok" for i in range(5))


def test_a_wait_that_runs_out_is_a_503_with_retry_after_that_says_why(caplog):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=0.3)) as served, \
                client() as session:
            await set_disabled(session, served, "a", True)
            took, answer = await timed(speech(session, served, "late"))
            await served.wait_idle()
            return took, answer, await scrape(session, served.url)

    took, (status, headers, body), metrics = run(main())
    assert 0.3 <= took < 2.0
    assert (status, headers["Retry-After"]) == (503, "1")
    assert "X-Omni-DP-Going-Away" not in headers  # this router stays: retry it
    error = error_body(body)
    assert error["type"] == "replica_wait_timeout"
    assert "within 0.3 s (--replica-wait)" in error["message"], error
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="timed_out") == 1
    assert sample(metrics, "omni_dp_router_admission_rejections_total",
                  reason="replica_wait_timeout") == 1
    route = routes(caplog)["late"]
    assert (route["status"], route["outcome"]) == (503, "replica_wait_timeout")
    assert 0.3 <= route["waited_s"] < 2.0


def test_the_wait_never_passes_the_request_timeout():
    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=30,
                                  request_timeout_s=0.4)) as served, client() as session:
            await set_disabled(session, served, "a", True)
            took, answer = await timed(speech(session, served, "deadline"))
            await served.wait_idle()
            return took, answer

    took, (status, _, body) = run(main())
    assert 0.4 <= took < 2.0
    assert status == 503
    error = error_body(body)
    assert error["type"] == "replica_wait_timeout"
    assert "what was left of --request-timeout" in error["message"], error


def test_a_waiting_request_holds_its_in_flight_slot():
    """--max-inflight 1: a request waiting for a replica is in flight, so the next one is
    refused at once (router_full): the waits are bounded by the in-flight bound."""

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=10,
                                  max_inflight=1)) as served, client() as session:
            await set_disabled(session, served, "a", True)
            first = asyncio.create_task(speech(session, served, "first"))
            await waiting(served)
            took, (status, _, body) = await timed(speech(session, served, "second"))
            await set_disabled(session, served, "a", False)
            first_status = (await asyncio.wait_for(first, 3))[0]
            await served.wait_idle()
            return took, status, error_body(body)["type"], first_status

    took, status, kind, first_status = run(main())
    assert (status, kind, first_status) == (503, "router_full", 200)
    assert took < 1.0


def test_a_router_that_begins_stopping_ends_every_wait_at_once():
    """Each waiting request is answered 503 saying the router is going away, so a router in
    front sends it elsewhere, instead of waiting out --replica-wait."""

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=10)) as served, \
                client() as session:
            await set_disabled(session, served, "a", True)
            asking = [asyncio.create_task(speech(session, served, f"s{i}")) for i in range(3)]
            await waiting(served, 3)
            served.router.begin_drain(5.0)
            took, answers = await timed(asyncio.gather(*asking))
            await served.wait_idle()
            return took, answers, await scrape(session, served.url)

    took, answers, metrics = run(main())
    assert took < 1.0
    for status, headers, body in answers:
        assert (status, headers["Retry-After"]) == (503, "1")
        assert headers["X-Omni-DP-Going-Away"] == "draining"
        assert error_body(body)["type"] == "stopping"
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="stopping") == 3


def test_replica_wait_0_keeps_the_503_at_once():
    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], replica_wait_s=0)) as served, \
                client() as session:
            await set_disabled(session, served, "a", True)
            problem = served.router.admission_problem()
            took, (status, headers, body) = await timed(speech(session, served, "now"))
            return problem, took, status, headers, body, await scrape(session, served.url)

    problem, took, status, headers, body, metrics = run(main())
    assert problem[0] == "no_routable_replica"
    assert took < 0.5
    assert (status, headers["Retry-After"]) == (503, "1")
    assert error_body(body)["type"] == "no_routable_replica"
    assert total(metrics, "omni_dp_router_replica_waits_total") == 0
