"""Admission control, the /workers admin API, --api-key, and /metrics, over real sockets."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from aiohttp import web

from omni_dp.router.relay import ReplicaAdded, ReplicaRemoved, ReplicaUpdated
from omni_dp.router.replicas import Health

from support.http_client import client, fetch
from support.ports import LOOPBACK, free_port
from support.router import (
    Backend,
    backends,
    error_body,
    hold_if_asked,
    make_config,
    replica_of,
    run,
    sample,
    scrape,
    serve,
)
from support.wait import until


def held_count(*bs: Backend) -> int:
    return sum(len(b.seen) for b in bs)


# --- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "reason"), [
    ({"max_inflight_per_replica": 1, "max_inflight": 10}, "replicas_full"),
    ({"max_inflight_per_replica": 1}, "router_full"),  # the default bound: 1 x 2 replicas
    ({"max_inflight": 2}, "router_full"),
])
def test_over_the_bound_gets_503_at_once(options, reason):
    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b")]
        async with backends(*bs), \
                serve(make_config([f"{b.name}={b.url}" for b in bs], **options)) as served, \
                client() as session:
            held = [asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1",
                                              data=b"{}")) for _ in range(2)]
            await until(lambda: held_count(*bs) == 2)
            assert sorted(served.in_flight().values()) == [1, 1]
            rejected = [await fetch(session, "POST", served.url + "/generate", data=b"{}",
                                    headers={"X-Request-ID": f"rej-{i}"}) for i in range(3)]
            assert held_count(*bs) == 2  # none of them went upstream
            metrics = await scrape(session, served.url)
            for b in bs:
                b.release.set()
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
            await served.wait_idle()
            after, _, _ = await fetch(session, "POST", served.url + "/generate", data=b"{}")
            return rejected, metrics, after

    rejected, metrics, after = run(main())
    for i, (status, headers, body) in enumerate(rejected):
        assert status == 503
        assert headers["Retry-After"] == "1"
        assert headers["X-Request-ID"] == f"rej-{i}"
        assert headers["Content-Type"].startswith("application/json")
        error = error_body(body)
        assert error["type"] == reason
        assert error["code"] == 503
    assert sample(metrics, "omni_dp_router_admission_rejections_total", reason=reason) == 3
    assert after == 200


def test_admission_503_comes_before_the_body_is_read():
    """A client announces a large body and never sends it: it still gets its 503."""

    async def main():
        backend = Backend("a", hold_if_asked)
        async with backends(backend), \
                serve(make_config([backend.url], max_inflight=1)) as served, \
                client() as session:
            held = asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1"))
            await until(lambda: len(backend.seen) == 1)
            port = int(served.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            try:
                writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: router\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
                             b'{"input": "')
                await writer.drain()
                status_line = await asyncio.wait_for(reader.readline(), 3)
            finally:
                writer.close()
            backend.release.set()
            assert (await held)[0] == 200
            await served.wait_idle()
            return status_line

    assert run(main()).startswith(b"HTTP/1.1 503")


def test_stopping_router_refuses_new_requests():
    async def main():
        async with backends("a") as (backend,), serve(make_config([backend.url])) as served, \
                client() as session:
            served.router.stopping = True
            status, headers, body = await fetch(session, "GET", served.url + "/v1/models")
            ready, _, _ = await fetch(session, "GET", served.url + "/ready")
            return status, headers.get("Retry-After"), error_body(body)["type"], ready

    assert run(main()) == (503, "1", "stopping", 503)


# --- the admin API -----------------------------------------------------------------------------


def test_workers_lists_every_replica():
    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"bee={b.url}"], policy="round_robin")) \
                as served, client() as session:
            await fetch(session, "GET", served.url + "/v1/models")
            await served.wait_idle()
            status, _, body = await fetch(session, "GET", served.url + "/workers")
            return status, json.loads(body), a.url, b.url

    status, listing, url_a, url_b = run(main())
    assert status == 200
    assert listing["policy"] == "round_robin"
    assert listing["in_flight"] == 0
    workers = {w["id"]: w for w in listing["workers"]}
    assert list(workers) == ["a", "bee"]
    assert workers["a"]["url"] == url_a and workers["bee"]["url"] == url_b
    assert workers["a"]["requests"] == 1 and workers["bee"]["requests"] == 0
    for worker in workers.values():
        assert worker["health"] == "healthy" and worker["routable"] is True
        assert worker["disabled"] is False and worker["in_flight"] == 0


def test_post_workers_adds_a_checked_replica_that_takes_traffic():
    async def main():
        async with backends("a", "c", "d") as (a, c, d), \
                serve(make_config([f"a={a.url}"], policy="round_robin")) as served, \
                client() as session:
            status, _, body = await fetch(session, "POST", served.url + "/workers",
                                          json={"url": c.url, "id": "c"})
            added = json.loads(body)
            assert status == 201, body
            picks = [await replica_of(session, served.url + "/v1/models") for _ in range(4)]
            # no id: the next free one; disabled: added but not routable
            status2, _, body2 = await fetch(session, "POST", served.url + "/workers",
                                            json={"url": d.url + "/", "disabled": True})
            # a replica whose port refuses: added, unknown, not routable
            dead = f"http://{LOOPBACK}:{free_port()}"
            status3, _, body3 = await fetch(session, "POST", served.url + "/workers",
                                            json={"url": dead, "id": "dead"})
            more = [await replica_of(session, served.url + "/v1/models") for _ in range(4)]
            _, _, listing = await fetch(session, "GET", served.url + "/workers")
            return (added, picks, status2, json.loads(body2), status3, json.loads(body3), more,
                    [w["id"] for w in json.loads(listing)["workers"]], c.health_probes, d.seen)

    (added, picks, status2, second, status3, third, more, ids, probes_c,
     d_seen) = run(main())
    assert added["id"] == "c" and added["health"] == "healthy" and added["routable"] is True
    assert probes_c == 1  # the immediate check, before the answer
    assert sorted(picks) == ["a", "a", "c", "c"]
    assert status2 == 201
    assert second["id"] == "0" and second["disabled"] is True and second["routable"] is False
    assert second["health"] == "healthy"  # checked even though disabled
    assert status3 == 201
    assert third["health"] == "unknown" and third["routable"] is False
    assert sorted(more) == ["a", "a", "c", "c"]
    assert d_seen == []
    assert ids == ["a", "c", "0", "dead"]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"url": "SAME_URL", "id": "other"}, 409, "already"),
    ({"url": "http://127.0.0.1:1", "id": "a"}, 409, "already"),
    ({"url": "ftp://127.0.0.1:1"}, 400, "http://HOST:PORT"),
    ({"url": "http://127.0.0.1:1/v1"}, 400, "path"),
    ({"url": "http://127.0.0.1:1", "id": "bad id!"}, 400, "replica id"),
    ({"url": "http://127.0.0.1:1", "weight": 2}, 400, "unknown field(s): weight"),
    ({"url": 8101}, 400, "url"),
    ({"id": "x"}, 400, "url is required"),
    ({"url": "http://127.0.0.1:1", "id": 5}, 400, "id must be a string"),
    ({"url": "http://127.0.0.1:1", "disabled": "no"}, 400, "disabled"),
    (b"not json", 400, "JSON object"),
    ([1, 2], 400, "JSON object"),
    (b"[" * 100_000, 400, "JSON object"),  # nested too deep for the JSON parser
    (b"\xff\xfe{}", 400, "JSON object"),
    ({"url": "http://[::1"}, 400, "http://HOST:PORT"),
    ({"url": "http://a b:1"}, 400, "whitespace"),
    ({"url": "http://127.0.0.1:1", "id": "a\n"}, 400, "replica id"),
])
def test_post_workers_refuses_bad_or_duplicate_replicas(body, status, words):
    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served, \
                client() as session:
            if body == {"url": "SAME_URL", "id": "other"}:
                payload = json.dumps({"url": a.url, "id": "other"}).encode()
            else:
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            got, _, answer = await fetch(session, "POST", served.url + "/workers", data=payload,
                                         headers={"Content-Type": "application/json"})
            _, _, listing = await fetch(session, "GET", served.url + "/workers")
            return got, answer, [w["id"] for w in json.loads(listing)["workers"]]

    got, answer, ids = run(main())
    assert got == status, answer
    error = error_body(answer)
    assert words in error["message"]
    assert error["code"] == status
    assert ids == ["a"]  # nothing added


def test_post_workers_bad_url_mentioning_already_is_400_not_409():
    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served, \
                client() as session:
            status, _, _ = await fetch(session, "POST", served.url + "/workers",
                                       json={"url": "http://already-up.local:1/path"})
            return status

    assert run(main()) == 400


def test_disabling_a_replica_stops_new_traffic_and_lets_in_flight_finish():
    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b")]
        async with backends(*bs) as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin")) \
                as served, client() as session:
            held = asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1"))
            await until(lambda: len(a.seen) == 1)  # round robin: the first goes to a
            status, _, body = await fetch(session, "PUT", served.url + "/workers/a",
                                          json={"disabled": True})
            assert status == 200, body
            described = json.loads(body)
            assert described["disabled"] is True and described["routable"] is False
            assert described["in_flight"] == 1
            while_disabled = [await replica_of(session, served.url + "/v1/models")
                              for _ in range(6)]
            a.release.set()
            held_status, held_headers, _ = await held
            assert held_status == 200 and held_headers["X-Omni-DP-Replica"] == "a"
            status, _, _ = await fetch(session, "PUT", served.url + "/workers/a",
                                       json={"disabled": False})
            assert status == 200
            await served.wait_idle()
            enabled = [await replica_of(session, served.url + "/v1/models") for _ in range(4)]
            return while_disabled, enabled, len(a.seen)

    while_disabled, enabled, a_seen = run(main())
    assert while_disabled == ["b"] * 6
    assert sorted(enabled) == ["a", "a", "b", "b"]
    assert a_seen == 3


@pytest.mark.parametrize("body", [
    {"disabled": "yes"}, {"disabled": 1}, {"disabled": True, "url": "http://127.0.0.1:2"},
    {}, b"{", b'"disabled"', None,
])
def test_invalid_put_changes_nothing(body):
    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served, \
                client() as session:
            before = served.replica("a").describe()
            payload = body if isinstance(body, bytes) or body is None else json.dumps(body)
            status, _, answer = await fetch(session, "PUT", served.url + "/workers/a",
                                            data=payload)
            missing, _, _ = await fetch(session, "PUT", served.url + "/workers/zzz",
                                        json={"disabled": True})
            routed, _, _ = await fetch(session, "GET", served.url + "/v1/models")
            after = served.replica("a").describe()
            return status, answer, missing, routed, before, after

    status, answer, missing, routed, before, after = run(main())
    assert status == 400
    assert error_body(answer)["type"] == "invalid_request"
    assert missing == 404
    assert routed == 200
    assert after["disabled"] is False and after["url"] == before["url"]


def test_delete_removes_a_replica_and_lets_its_in_flight_request_finish():
    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b")]
        async with backends(*bs) as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin")) \
                as served, client() as session:
            held = asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1"))
            await until(lambda: len(a.seen) == 1)
            status, _, body = await fetch(session, "DELETE", served.url + "/workers/a")
            assert status == 200, body
            assert json.loads(body)["id"] == "a"
            again, _, _ = await fetch(session, "DELETE", served.url + "/workers/a")
            unknown, _, _ = await fetch(session, "DELETE", served.url + "/workers/nope")
            after = [await replica_of(session, served.url + "/v1/models") for _ in range(4)]
            a.release.set()
            held_status, _, _ = await held
            _, _, listing = await fetch(session, "GET", served.url + "/workers")
            metrics = await scrape(session, served.url)
            await served.wait_idle()
            return (again, unknown, after, held_status,
                    [w["id"] for w in json.loads(listing)["workers"]], metrics, len(a.seen))

    again, unknown, after, held_status, ids, metrics, a_seen = run(main())
    assert (again, unknown) == (404, 404)
    assert after == ["b"] * 4
    assert held_status == 200
    assert ids == ["b"]
    assert a_seen == 1
    assert sample(metrics, "omni_dp_router_in_flight", replica="b") == 0
    assert ("omni_dp_router_in_flight", (("replica", "a"),)) not in metrics


def remote_middleware(address: str):
    """Makes the router see every client as coming from `address` (no non-loopback socket)."""

    @web.middleware
    async def fake_remote(request, handler):
        return await handler(request.clone(remote=address))

    return fake_remote


@pytest.mark.parametrize("allow", [False, True])
def test_admin_api_answers_loopback_clients_only(allow):
    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], admin_allow_remote=allow,
                                  # allowed, the calls leave no replica: answered at once
                                  replica_wait_s=0),
                      middlewares=(remote_middleware("203.0.113.7"),)) as served, \
                client() as session:
            results = {}
            for method, path, payload in (
                ("GET", "/workers", None),
                ("POST", "/workers", {"url": "http://127.0.0.1:1", "id": "x"}),
                ("PUT", "/workers/a", {"disabled": True}),
                ("DELETE", "/workers/a", None),
            ):
                status, _, body = await fetch(session, method, served.url + path, json=payload)
                results[(method, path)] = status, body
            proxied, _, _ = await fetch(session, "GET", served.url + "/v1/models")
            metrics, _, _ = await fetch(session, "GET", served.url + "/metrics")
            return results, proxied, metrics, [r.id for r in served.router.replicas]

    results, proxied, metrics, ids = run(main())
    if allow:
        assert [s for s, _ in results.values()] == [200, 201, 200, 200]
        assert ids == ["x"]
    else:
        for status, body in results.values():
            assert status == 403
            assert error_body(body)["type"] == "forbidden"
        assert ids == ["a"]
        assert proxied == 200  # only the admin routes are loopback-only
    assert metrics == 200


# --- --api-key ---------------------------------------------------------------------------------


def test_api_key_guards_proxied_and_admin_routes_but_not_ops():
    key = "s3cret-key"

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], api_key=key)) as served, client() as session:
            out = {}
            for name, headers in (
                ("none", {}),
                ("wrong", {"Authorization": "Bearer nope"}),
                ("basic", {"Authorization": f"Basic {key}"}),
                ("bearer", {"Authorization": f"Bearer {key}"}),
                ("x-api-key", {"X-API-Key": key}),
                ("wrong-x-api-key", {"X-API-Key": key + "x"}),
            ):
                for path in ("/v1/audio/speech", "/workers"):
                    method = "POST" if path != "/workers" else "GET"
                    status, _, body = await fetch(session, method, served.url + path,
                                                  headers=headers, data=b"{}")
                    out[(name, path)] = status, body
            ops = {path: (await fetch(session, "GET", served.url + path))[0]
                   for path in ("/health", "/ready", "/live", "/metrics")}
            return out, ops, len(a.seen)

    out, ops, seen = run(main())
    for name in ("none", "wrong", "basic", "wrong-x-api-key"):
        for path in ("/v1/audio/speech", "/workers"):
            status, body = out[(name, path)]
            assert status == 401, (name, path)
            assert error_body(body)["type"] == "unauthorized"
    for name in ("bearer", "x-api-key"):
        assert out[(name, "/v1/audio/speech")][0] == 200
        assert out[(name, "/workers")][0] == 200
    assert ops == {"/health": 200, "/ready": 200, "/live": 200, "/metrics": 200}
    assert seen == 2  # only the authorised proxied requests went upstream


# --- /metrics ----------------------------------------------------------------------------------

FAMILIES = (
    "omni_dp_router_requests_total", "omni_dp_router_in_flight",
    "omni_dp_router_replica_healthy", "omni_dp_router_ejections_total",
    "omni_dp_router_admission_rejections_total", "omni_dp_router_request_duration_seconds",
    "omni_dp_router_ttfb_seconds",
)


def test_metrics_families_and_values_follow_the_traffic():
    async def main():
        backend = Backend("a", hold_if_asked)
        async with backends(backend), \
                serve(make_config([f"a={backend.url}"], max_inflight=1, failures=2)) as served, \
                client() as session:
            async with session.get(served.url + "/metrics") as resp:
                assert resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
            start = await scrape(session, served.url)
            held = asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1"))
            await until(lambda: len(backend.seen) == 1)
            rejected, _, _ = await fetch(session, "POST", served.url + "/generate")
            during = await scrape(session, served.url)
            backend.release.set()
            await held
            await served.wait_idle()
            for status in (200, 500, 404):
                await fetch(session, "POST", served.url + f"/generate?status={status}")
            await served.wait_idle()
            traffic = await scrape(session, served.url)
            for _ in range(2):
                await fetch(session, "POST", served.url + "/generate?status=502")
            await served.wait_idle()
            ejected = await scrape(session, served.url)
            return text, start, rejected, during, traffic, ejected

    text, start, rejected, during, traffic, ejected = run(main())
    for family in FAMILIES:
        assert f"# TYPE {family}" in text, family
    assert rejected == 503

    assert sample(start, "omni_dp_router_in_flight", replica="a") == 0
    assert sample(start, "omni_dp_router_replica_healthy", replica="a") == 1
    assert sample(start, "omni_dp_router_ejections_total", replica="a") == 0
    assert sample(start, "omni_dp_router_request_duration_seconds_count") == 0
    assert sample(start, "omni_dp_router_ttfb_seconds_count") == 0

    assert sample(during, "omni_dp_router_in_flight", replica="a") == 1
    assert sample(during, "omni_dp_router_admission_rejections_total", reason="router_full") == 1

    assert sample(traffic, "omni_dp_router_in_flight", replica="a") == 0
    assert sample(traffic, "omni_dp_router_requests_total", replica="a", status="200") == 2
    assert sample(traffic, "omni_dp_router_requests_total", replica="a", status="500") == 1
    assert sample(traffic, "omni_dp_router_requests_total", replica="a", status="404") == 1
    # every request ends in the duration histogram (the rejected one too); four had a body
    assert sample(traffic, "omni_dp_router_request_duration_seconds_count") == 5
    assert sample(traffic, "omni_dp_router_ttfb_seconds_count") == 4
    assert sample(traffic, "omni_dp_router_ttfb_seconds_bucket", le="+Inf") == 4

    assert sample(ejected, "omni_dp_router_requests_total", replica="a", status="502") == 2
    assert sample(ejected, "omni_dp_router_ejections_total", replica="a") == 1
    assert sample(ejected, "omni_dp_router_replica_healthy", replica="a") == 0


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_api_key_exempts_only_reading_the_ops_endpoints(method):
    """Any other method on an ops path is forwarded to a replica: it needs the key."""
    key = "s3cret-key"

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], api_key=key)) as served, client() as session:
            refused = {path: await fetch(session, method, served.url + path, data=b"{}")
                       for path in ("/health", "/ready", "/live", "/metrics")}
            head = (await fetch(session, "HEAD", served.url + "/ready"))[0]
            keyed = (await fetch(session, method, served.url + "/health", data=b"{}",
                                 headers={"Authorization": f"Bearer {key}"}))[0]
            return refused, head, keyed, [(s.method, s.raw_path) for s in a.seen]

    refused, head, keyed, seen = run(main())
    for path, (status, _, body) in refused.items():
        assert status == 401, path
        assert error_body(body)["type"] == "unauthorized"
    assert head == 200
    assert keyed == 200  # with the key, it is an ordinary proxied request
    assert seen == [(method, "/health")]


@pytest.mark.parametrize("header", [
    "bearer {key}", "BEARER {key}", "BeArEr {key}", "Bearer   {key}",
])
def test_bearer_scheme_is_case_insensitive(header):
    key = "s3cret-key"

    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], api_key=key)) as served, client() as session:
            good = (await fetch(session, "GET", served.url + "/v1/models",
                                headers={"Authorization": header.format(key=key)}))[0]
            bad = (await fetch(session, "GET", served.url + "/v1/models",
                               headers={"Authorization": header.format(key=key + "x")}))[0]
            return good, bad, len(a.seen)

    assert run(main()) == (200, 401, 1)


# --- enabling through the admin API ------------------------------------------------------------


def test_enabling_a_disabled_replica_makes_it_routable_at_once():
    """The supervisor's flow: disable, the replica restarts (the router's probes fail and eject
    it), the gates pass, enable. The very next request goes to it, with no probe in between."""

    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b")]
        async with backends(*bs) as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], failures=2, successes=2)) \
                as served, client() as session:
            replica = served.replica("a")
            status, _, _ = await fetch(session, "PUT", served.url + "/workers/a",
                                       json={"disabled": True})
            assert status == 200
            a.health_status = 503  # restarting
            for _ in range(2):
                await served.router.health.check_all()
            assert replica.health.value == "unhealthy"
            a.health_status = 200  # back, and through the supervisor's gates
            probes = a.health_probes
            # b is busy, so least_request sends the next request to a if a is routable at all
            held = asyncio.create_task(fetch(session, "POST", served.url + "/generate?hold=1"))
            await until(lambda: len(b.seen) == 1)
            status, _, body = await fetch(session, "PUT", served.url + "/workers/a",
                                          json={"disabled": False})
            described = json.loads(body)
            next_replica = await replica_of(session, served.url + "/v1/models")
            b.release.set()
            await held
            await served.wait_idle()
            return status, described, next_replica, a.health_probes - probes

    status, described, next_replica, probes = run(main())
    assert status == 200
    assert described["routable"] is True and described["health"] == "healthy"
    assert next_replica == "a"
    assert probes == 0  # routable on the admin's word, not on a probe of ours


def test_an_ejected_replica_nobody_disabled_still_needs_its_probes():
    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], failures=1, successes=2)) \
                as served, client() as session:
            a.health_status = 503
            await served.router.health.check_all()
            a.health_status = 200
            status, _, body = await fetch(session, "PUT", served.url + "/workers/a",
                                          json={"disabled": False})
            after_put = json.loads(body)["routable"]
            await served.router.health.check_all()
            after_one = served.replica("a").routable
            await served.router.health.check_all()
            return status, after_put, after_one, served.replica("a").routable

    assert run(main()) == (200, False, False, True)


def test_an_enable_relayed_from_a_sibling_process_is_routable_at_once():
    async def main():
        async with backends("a") as (a,), serve(make_config([f"a={a.url}"])) as served:
            router = served.router
            await router.apply_change(ReplicaUpdated("a", True))
            served.replica("a").health = Health.UNHEALTHY  # ejected while it restarted
            await router.apply_change(ReplicaUpdated("a", False))
            return served.replica("a").routable

    assert run(main()) is True


def test_a_change_is_announced_to_the_sibling_processes_typed():
    """What one router process tells its siblings (--workers K) is a typed change, which
    survives the pipe (pickled) and applies there as it was made."""
    async def main():
        async with backends("a", "b") as (a, b), serve(make_config([f"a={a.url}"])) as served:
            router, sent = served.router, []
            router.on_change = sent.append
            await router.add_replica(b.url, "b", True)
            router.set_disabled(served.replica("b"), False)
            router.remove_replica("b")
            for change in sent:  # as a sibling receives them
                await router.apply_change(pickle.loads(pickle.dumps(change)))
            return sent, sorted(r.id for r in router.replicas)

    sent, ids = run(main())
    assert [type(c) for c in sent] == [ReplicaAdded, ReplicaUpdated, ReplicaRemoved]
    assert (sent[0].id, sent[0].disabled, sent[1], sent[2]) == (
        "b", True, ReplicaUpdated("b", False), ReplicaRemoved("b"))
    assert ids == ["a"]  # re-applied in order: added again, enabled, removed again
