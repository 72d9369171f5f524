"""Priority classes at the router (issue 42): a request's class from X-Omni-DP-Priority (or
smg's x-smg-priority, or the defaults) decides its place in the queues for in-flight slots
(interactive, then default, then bulk), the slots kept for interactive requests
(--reserved-interactive), how long it may queue (--queue-timeout-CLASS), the class header the
replica gets, and with --priority-field vLLM's `priority` in the body."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from omni_dp.contract import Priority
from omni_dp.speech_stream import SPEECH_STREAM_PATH

from support.http_client import client, fetch
from support.router import (
    Backend,
    backends,
    error_body,
    hold_if_asked,
    make_config,
    routes,
    run,
    sample,
    scrape,
    serve,
)
from support.wait import until


def post(session, served, path: str = "/v1/audio/speech", priority: str | None = None,
         data: bytes = b'{"input": "x"}', **headers):
    if priority is not None:
        headers["X-Omni-DP-Priority"] = priority
    return fetch(session, "POST", served.url + path, data=data, headers=headers)


async def queued(served, count: int) -> None:
    await until(lambda: len(served.router.queues) == count, 3, f"{count} request(s) queued")


def test_an_interactive_request_overtakes_the_bulk_requests_queued_before_it():
    """--max-inflight 1, held by a bulk request: two more bulk requests queue, then an
    interactive one; once the slot frees, the interactive one is the next the replica gets."""

    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1)) as served, \
                client() as session:
            asking = [asyncio.create_task(post(session, served, "/first?hold=1", "bulk"))]
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            for name in ("bulk1", "bulk2"):
                asking.append(asyncio.create_task(post(session, served, f"/{name}", "bulk")))
                await queued(served, len(asking) - 1)
            asking.append(asyncio.create_task(post(session, served, "/inter", "interactive")))
            await queued(served, 3)
            depth = [served.router.queues.depth(p) for p in Priority]
            a.release.set()
            answers = await asyncio.wait_for(asyncio.gather(*asking), 5)
            await served.wait_idle()
            return depth, answers, [seen.raw_path for seen in a.seen], \
                await scrape(session, served.url)

    depth, answers, order, metrics = run(main())
    assert [status for status, _, _ in answers] == [200] * 4
    assert order == ["/first?hold=1", "/inter", "/bulk1", "/bulk2"]
    assert depth == [1, 0, 2]  # interactive, default, bulk
    assert sample(metrics, "omni_dp_router_queue_wait_seconds_count", priority="bulk") == 2
    assert sample(metrics, "omni_dp_router_queue_wait_seconds_count",
                  priority="interactive") == 1
    assert sample(metrics, "omni_dp_router_queue_depth", priority="bulk") == 0


def test_the_last_slots_are_kept_for_interactive_requests():
    """--max-inflight 2 --reserved-interactive 1: one default request in flight leaves one
    slot, which a default request may not take (503 at once, as a full router answers) and
    an interactive one may."""

    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=2,
                                  reserved_interactive=1)) as served, client() as session:
            first = asyncio.create_task(post(session, served, "/first?hold=1"))
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            refused = await post(session, served, "/second")
            interactive = asyncio.create_task(post(session, served, "/inter?hold=1",
                                                   "interactive"))
            await until(lambda: len(a.seen) == 2, 3, "the interactive request at the replica")
            a.release.set()
            answers = await asyncio.wait_for(asyncio.gather(first, interactive), 5)
            await served.wait_idle()
            return refused, answers

    (status, headers, body), answers = run(main())
    assert status == 503 and headers["Retry-After"]
    error = error_body(body)
    assert error["type"] == "router_full" and "--reserved-interactive" in error["message"]
    assert [answer[0] for answer in answers] == [200, 200]


def test_a_request_whose_queue_timeout_passes_gets_503_naming_its_class():
    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1,
                                  queue_timeout_bulk_s=0.2)) as served, client() as session:
            first = asyncio.create_task(post(session, served, "/first?hold=1", "interactive"))
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            refused = await post(session, served, "/late", "bulk")
            a.release.set()
            await asyncio.wait_for(first, 5)
            await served.wait_idle()
            return refused, [seen.raw_path for seen in a.seen], await scrape(session, served.url)

    (status, headers, body), seen, metrics = run(main())
    assert status == 503 and headers["Retry-After"]
    error = error_body(body)
    assert error["type"] == "queue_timeout"
    assert "bulk request" in error["message"] and "--queue-timeout-bulk" in error["message"]
    assert seen == ["/first?hold=1"]
    assert sample(metrics, "omni_dp_router_queue_timeouts_total", priority="bulk") == 1
    assert sample(metrics, "omni_dp_router_admission_rejections_total",
                  reason="queue_timeout") == 1


def test_a_class_header_that_names_no_class_is_a_400_naming_the_header():
    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served, \
                client() as session:
            answer = await post(session, served, priority="urgent")
            return answer, len(a.seen)

    (status, _, body), reached = run(main())
    assert status == 400 and reached == 0
    error = error_body(body)
    assert error["type"] == "invalid_priority"
    assert "X-Omni-DP-Priority" in error["message"]
    assert "interactive, default, bulk" in error["message"]


def test_the_replica_gets_the_class_in_its_header():
    """Named by the client, by smg's header (system is interactive; ours wins), or by the
    route's default (--route-priority)."""

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], route_priorities=(
                    "/v1/audio/speech=interactive",))) as served, client() as session:
            asked = [
                post(session, served, "/v1/x", "bulk"),
                post(session, served, "/v1/x", **{"x-smg-priority": "system"}),
                post(session, served, "/v1/x", "bulk", **{"x-smg-priority": "interactive"}),
                post(session, served, "/v1/audio/speech"),
                post(session, served, "/v1/x"),
            ]
            statuses = [(await ask)[0] for ask in asked]
            return statuses, [seen.headers["X-Omni-DP-Priority"] for seen in a.seen]

    statuses, classes = run(main())
    assert statuses == [200] * 5
    assert classes == ["bulk", "interactive", "bulk", "interactive", "default"]


def test_the_priority_field_reaches_a_vllm_replica_only_when_enabled():
    """--priority-field (launch sets it for vLLM with --scheduling-policy priority): the class
    as vLLM's `priority` in completions and chat bodies, unless the client set one."""

    async def send_all(priority_field: bool) -> list[dict]:
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], priority_field=priority_field)) as served, \
                client() as session:
            for path, priority, body in (
                    ("/v1/chat/completions", "interactive", {"messages": []}),
                    ("/v1/completions", "bulk", {"prompt": "x"}),
                    ("/v1/completions", "bulk", {"prompt": "x", "priority": 5}),
                    ("/v1/audio/speech", "bulk", {"input": "x"})):
                status, _, _ = await post(session, served, path, priority,
                                          data=json.dumps(body).encode())
                assert status == 200
            return [json.loads(seen.body) for seen in a.seen]

    enabled, disabled = run(send_all(True)), run(send_all(False))
    assert [body.get("priority") for body in enabled] == [-1, 1, 5, None]
    assert [body.get("priority") for body in disabled] == [None, None, 5, None]


def test_a_speech_session_with_a_bad_class_header_is_refused_400():
    """The WebSocket speech session takes its class like any request (it queues for its
    in-flight slot too)."""

    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served, \
                client() as session:
            try:
                await session.ws_connect(served.url + SPEECH_STREAM_PATH,
                                         headers={"X-Omni-DP-Priority": "urgent"})
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status, len(a.seen)
            raise AssertionError("the session was opened")

    assert run(main()) == (400, 0)


def test_a_bulk_request_taken_back_for_an_interactive_one_is_answered_by_another_replica(
        caplog):
    """--max-inflight 1, held by a bulk request whose replica has not answered yet: an
    interactive request that arrives takes its slot (the bulk request is taken back, not
    failed), and the bulk request is sent again once the slot frees, to the other replica."""
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")

    async def main():
        async with backends(Backend("a", hold_if_asked), Backend("b", hold_if_asked)) as pair, \
                serve(make_config([f"a={pair[0].url}", f"b={pair[1].url}"], max_inflight=1,
                                  queue_timeout_interactive_s=5)) as served, \
                client() as session:
            bulk = asyncio.create_task(post(session, served, "/bulk?hold=1", "bulk",
                                            **{"X-Request-ID": "bulk"}))
            await until(lambda: sum(len(b.seen) for b in pair) == 1, 3, "the bulk request sent")
            first = next(b for b in pair if b.seen)
            other = next(b for b in pair if b is not first)
            interactive = await post(session, served, "/inter", "interactive")
            await until(lambda: "/bulk?hold=1" in [s.raw_path for s in other.seen], 3,
                        "the bulk request sent again")
            for backend in pair:
                backend.release.set()
            bulk_answer = await asyncio.wait_for(bulk, 5)
            await served.wait_idle()
            return (first.name, interactive, bulk_answer,
                    {b.name: [s.raw_path for s in b.seen] for b in pair},
                    await scrape(session, served.url))

    first, interactive, bulk, seen, metrics = run(main())
    assert interactive[0] == 200
    status, headers, _ = bulk
    assert status == 200 and headers["X-Omni-DP-Replica"] != first
    other = "b" if first == "a" else "a"
    assert seen[first][0] == "/bulk?hold=1" and "/bulk?hold=1" in seen[other]
    assert seen[first].count("/bulk?hold=1") == 1  # never back to the replica it tried
    assert sample(metrics, "omni_dp_router_preemptions_total") == 1
    line = routes(caplog)["bulk"]
    assert line["preempted"] == 1 and line["tried"] == [first, other]
    assert line["retries"] == [] and line["status"] == 200


def test_a_bulk_request_with_no_other_replica_to_go_to_is_not_taken_back():
    """One replica: taking the bulk request back would leave it nowhere to go; the
    interactive request waits for the slot instead."""

    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1)) as served, \
                client() as session:
            bulk = asyncio.create_task(post(session, served, "/bulk?hold=1", "bulk"))
            await until(lambda: len(a.seen) == 1, 3, "the bulk request sent")
            interactive = asyncio.create_task(post(session, served, "/inter", "interactive"))
            await queued(served, 1)
            a.release.set()
            answers = await asyncio.wait_for(asyncio.gather(bulk, interactive), 5)
            await served.wait_idle()
            return answers, [s.raw_path for s in a.seen], await scrape(session, served.url)

    answers, seen, metrics = run(main())
    assert [answer[0] for answer in answers] == [200, 200]
    assert seen == ["/bulk?hold=1", "/inter"]
    assert sample(metrics, "omni_dp_router_preemptions_total") == 0


def test_a_router_that_begins_stopping_answers_every_queued_request_at_once():
    """503 saying the router is going away, so a router in front sends it elsewhere."""

    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1)) as served, \
                client() as session:
            first = asyncio.create_task(post(session, served, "/first?hold=1", "bulk"))
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            second = asyncio.create_task(post(session, served, "/second", "bulk"))
            await queued(served, 1)
            served.router.begin_drain(5.0)
            refused = await asyncio.wait_for(second, 3)
            a.release.set()
            await asyncio.wait_for(first, 3)
            return refused, len(served.router.queues), [s.raw_path for s in a.seen]

    (status, headers, body), left, seen = run(main())
    assert status == 503 and headers["X-Omni-DP-Going-Away"] == "draining"
    assert error_body(body)["type"] == "stopping"
    assert left == 0 and seen == ["/first?hold=1"]


def test_queued_requests_are_served_interactive_then_default_then_bulk():
    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1,
                                  queue_timeout_default_s=5)) as served, \
                client() as session:
            asking = [asyncio.create_task(post(session, served, "/first?hold=1"))]
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            for priority in ("bulk", "default", "interactive"):
                asking.append(asyncio.create_task(post(session, served, f"/{priority}",
                                                       priority)))
                await queued(served, len(asking) - 1)
            a.release.set()
            answers = await asyncio.wait_for(asyncio.gather(*asking), 5)
            await served.wait_idle()
            return [answer[0] for answer in answers], [s.raw_path for s in a.seen]

    statuses, seen = run(main())
    assert statuses == [200] * 4
    assert seen == ["/first?hold=1", "/interactive", "/default", "/bulk"]


def test_a_client_that_leaves_while_queued_leaves_no_waiter_behind():
    async def main():
        async with backends(Backend("a", hold_if_asked)) as (a,), \
                serve(make_config([f"a={a.url}"], max_inflight=1)) as served, \
                client() as session:
            first = asyncio.create_task(post(session, served, "/first?hold=1", "bulk"))
            await until(lambda: len(a.seen) == 1, 3, "the first request at the replica")
            leaving = asyncio.create_task(post(session, served, "/leaving", "bulk"))
            await queued(served, 1)
            leaving.cancel()
            await queued(served, 0)
            a.release.set()
            await asyncio.wait_for(first, 3)
            after = await post(session, served, "/after", "bulk")
            await served.wait_idle()
            return after[0], served.router.num_granted, [s.raw_path for s in a.seen], \
                await scrape(session, served.url)

    status, granted, seen, metrics = run(main())
    assert status == 200 and granted == 0
    assert seen == ["/first?hold=1", "/after"]
    assert sample(metrics, "omni_dp_router_queue_depth", priority="bulk") == 0
    assert sample(metrics, "omni_dp_router_queue_wait_seconds_count", priority="bulk") == 1
