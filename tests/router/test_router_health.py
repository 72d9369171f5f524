"""Replica health through the router: passive ejection, active checks, re-admission, /ready."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from omni_dp.router.app import Router
from omni_dp.router.replicas import Health

from support.http_client import client, fetch
from support.router import (
    Backend,
    backends,
    make_config,
    replica_of,
    run,
    sample,
    scrape,
    serve,
    status_from_query,
    total,
)
from support.wait import until


def test_refused_connections_eject_after_the_threshold():
    async def main():
        async with backends("a", "b") as (a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  failures=2)) as served, client() as session:
            await a.stop()
            await asyncio.sleep(0.05)
            replica_a = served.replica("a")
            states = []
            for _ in range(6):
                # a 200 from b every time: retried there
                assert await replica_of(session, served.url + "/v1/models") == "b"
                states.append(replica_a.health)
            await served.wait_idle()
            return states, replica_a.num_ejections, len(b.seen), await scrape(session, served.url)

    states, ejections, b_seen, metrics = run(main())
    # round robin tries a on the 1st and 2nd requests; the 2nd failure ejects it
    assert states == [Health.HEALTHY] + [Health.UNHEALTHY] * 5
    assert ejections == 1
    assert b_seen == 6
    assert total(metrics, "omni_dp_router_retries_total") == 2  # none once a is out
    assert sample(metrics, "omni_dp_router_ejections_total", replica="a") == 1
    assert sample(metrics, "omni_dp_router_replica_healthy", replica="a") == 0
    assert sample(metrics, "omni_dp_router_replica_healthy", replica="b") == 1


@pytest.mark.parametrize("status", [502, 504])
def test_gateway_errors_eject_after_consecutive_failures(status):
    async def main():
        # --replica-wait 0: with no replica left, the 503 comes at once
        async with backends(Backend("a", status_from_query)) as (a,), \
                serve(make_config([f"a={a.url}"], failures=3,
                                  replica_wait_s=0)) as served, client() as session:
            replica = served.replica("a")
            routable, statuses = [], []
            for _ in range(3):
                got, _, _ = await fetch(session, "POST", served.url + f"/generate?status={status}")
                statuses.append(got)
                routable.append(replica.routable)
            got, headers, _ = await fetch(session, "POST", served.url + "/generate")
            statuses.append(got)
            assert headers["Retry-After"] == "1"
            await served.wait_idle()
            return statuses, routable, replica.num_ejections, replica.last_error, len(a.seen)

    statuses, routable, ejections, last_error, seen = run(main())
    assert statuses == [status, status, status, 503]  # relayed as-is, then no replica left
    assert routable == [True, True, False]
    assert ejections == 1
    assert str(status) in last_error
    assert seen == 3


def test_a_success_in_between_resets_the_failure_count():
    async def main():
        async with backends(Backend("a", status_from_query)) as (a,), \
                serve(make_config([f"a={a.url}"], failures=3)) as served, client() as session:
            replica = served.replica("a")
            for status in (502, 502, 200, 504, 504, 200, 502, 502):
                got, _, _ = await fetch(session, "POST", served.url + f"/x?status={status}")
                assert got == status
            return replica.routable, replica.consecutive_failures

    assert run(main()) == (True, 2)


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_ordinary_error_statuses_never_eject(status):
    async def main():
        async with backends(Backend("a", status_from_query)) as (a,), \
                serve(make_config([f"a={a.url}"], failures=1)) as served, client() as session:
            replica = served.replica("a")
            for _ in range(20):
                got, headers, _ = await fetch(session, "POST",
                                              served.url + f"/generate?status={status}")
                assert got == status
                assert headers["X-Omni-DP-Replica"] == "a"
            await served.wait_idle()
            return replica.routable, replica.num_ejections, replica.consecutive_failures

    assert run(main()) == (True, 0, 0)


def test_failing_health_check_ejects_and_ready_turns_503():
    async def main():
        async with backends("a") as (a,), \
                serve(make_config([f"a={a.url}"], interval=0.05, failures=2,
                                  replica_wait_s=0)) as served, \
                client() as session:  # --replica-wait 0: the proxied 503 comes at once
            assert (await fetch(session, "GET", served.url + "/ready"))[0] == 200
            a.health_status = 500
            probes_at_flip = a.health_probes
            await until(lambda: served.replica("a").health == Health.UNHEALTHY, 3, "ejection")
            probes = a.health_probes - probes_at_flip
            status, _, body = await fetch(session, "GET", served.url + "/ready")
            proxied, headers, _ = await fetch(session, "GET", served.url + "/v1/models")
            return probes, status, body, proxied, headers, len(a.seen)

    probes, status, body, proxied, headers, seen = run(main())
    assert probes >= 2  # failure_threshold consecutive failed checks
    assert status == 503
    assert b'"routable_replicas": 0' in body
    assert proxied == 503
    assert headers["Retry-After"] == "1"
    assert seen == 0


def test_readmission_needs_success_threshold_consecutive_checks():
    """Probes answer a script; as it serves each probe the backend notes the router's view,
    which is the state after the previous probe. failures=1, successes=3."""
    script = [503, 200, 200, 500, 200, 200, 200, 200]

    async def main():
        backend = Backend("a")
        async with backends(backend):
            config = make_config([f"a={backend.url}"], interval=0.02, failures=1, successes=3)
            async with serve(config) as served, client() as session:
                replica = served.replica("a")
                views: list[tuple[Health, int]] = []

                def on_probe(b: Backend) -> None:
                    if len(views) < len(script):
                        views.append((replica.health, replica.consecutive_successes))
                        b.health_status = script[len(views) - 1]

                backend.on_probe = on_probe
                await until(lambda: len(views) == len(script), 3, "the scripted probes")
                await until(lambda: replica.health == Health.HEALTHY, 3, "re-admission")
                routed, _, _ = await fetch(session, "GET", served.url + "/v1/models")
                return views, routed, replica.num_ejections

    views, routed, ejections = run(main())
    U, H = Health.UNHEALTHY, Health.HEALTHY
    assert views == [
        (H, views[0][1]),  # serving the 503, which ejects
        (U, 0), (U, 1), (U, 2),  # two good checks, then a failed one restarts the count
        (U, 0), (U, 1), (U, 2),  # three good checks ...
        (H, 3),  # ... re-admit
    ]
    assert routed == 200
    assert ejections == 1


def test_replica_starts_unknown_and_ready_follows_the_first_good_check():
    async def main():
        backend = Backend("a")
        backend.health_status = 503
        async with backends(backend):
            # --replica-wait 0: while none is routable, a request is refused at once
            config = make_config([f"a={backend.url}"], interval=0.05, successes=5,
                                 replica_wait_s=0)
            unstarted = Router(config)
            assert [r.health for r in unstarted.replicas] == [Health.UNKNOWN]
            assert unstarted.admission_problem()[0] == "no_routable_replica"
            async with serve(config) as served, client() as session:
                replica = served.replica("a")
                assert backend.health_probes >= 1  # checked before serving
                assert replica.health == Health.UNKNOWN
                ready, _, _ = await fetch(session, "GET", served.url + "/ready")
                health, _, _ = await fetch(session, "GET", served.url + "/health")
                live, _, _ = await fetch(session, "GET", served.url + "/live")
                proxied, _, body = await fetch(session, "GET", served.url + "/v1/models")
                assert (ready, health, live, proxied) == (503, 503, 200, 503)
                assert b"no_routable_replica" in body
                assert backend.seen == []
                backend.health_status = 200
                # from unknown, ONE good check is enough (success_threshold is for ejected ones)
                await until(lambda: replica.health == Health.HEALTHY, 3, "first good check")
                ready, _, _ = await fetch(session, "GET", served.url + "/ready")
                proxied, _, _ = await fetch(session, "GET", served.url + "/v1/models")
                return ready, proxied, replica.num_ejections

    assert run(main()) == (200, 200, 0)


def test_unreachable_replica_at_start_is_not_routable():
    async def main():
        async with backends("a", "b") as (a, b):
            url_b = b.url
            await b.stop()  # b's port refuses from the start
            config = make_config([f"a={a.url}", f"b={url_b}"], policy="round_robin")
            async with serve(config) as served, client() as session:
                assert served.replica("b").health == Health.UNKNOWN
                picks = [await replica_of(session, served.url + "/v1/models") for _ in range(4)]
                ready, _, body = await fetch(session, "GET", served.url + "/ready")
                return picks, ready, body, await scrape(session, served.url)

    picks, ready, body, metrics = run(main())
    assert picks == ["a"] * 4
    assert ready == 200
    assert b'"routable_replicas": 1' in body and b'"total_replicas": 2' in body
    assert total(metrics, "omni_dp_router_retries_total") == 0  # b is never tried


async def hold(backend, request, seen):
    await backend.release.wait()
    return web.json_response({"backend": backend.name})


def test_a_replica_busy_at_its_cap_is_still_checked_and_not_ejected():
    async def main():
        backend = Backend("a", hold)
        async with backends(backend), \
                serve(make_config([f"a={backend.url}"], interval=0.05, health_timeout=0.2,
                                  failures=2, max_inflight_per_replica=1)) as served, \
                client() as session:
            busy = asyncio.create_task(fetch(session, "POST", served.url + "/v1/audio/speech"))
            await until(lambda: len(backend.seen) == 1)
            probes = backend.health_probes
            replica = served.replica("a")
            # either 3 probes get through during the long request, or the replica is ejected
            await until(lambda: backend.health_probes >= probes + 3 or not replica.routable, 3)
            ejected = not replica.routable
            backend.release.set()
            assert (await busy)[0] == 200
            return ejected, backend.health_probes - probes

    ejected, probes = run(main())
    assert not ejected
    assert probes >= 3
