"""Overload is not a fault: --max-ejection-percent bounds the replicas the router ejects at once
for failures or a hang, so a flood that makes every replica slow to answer (its /health too)
leaves the rest routable; a replica whose port refuses connections (its process is gone) still
leaves the rotation, whatever the bound; a replica re-admitted frees its share of the bound."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from omni_dp.router.config import HealthConfig, RouterConfigError, plan_router
from omni_dp.router.health import (
    connection_refused,
    ejection_bound,
    may_eject,
    record_failure,
    record_hang,
    record_success,
)
from omni_dp.router.replicas import Backends, Ejected, Health, Replica

from support.http_client import client, fetch
from support.router import Backend, backends, make_config, run, sample, scrape, serve
from support.wait import until

# The check of a late replica may take min(0.3, T / 2): it starts 0.3 s after the request.
TIMEOUTS = {"first_byte_timeout_s": 0.6, "stall_timeout_s": 0.6, "health_timeout": 0.3}


# --- the decision, without a router ----------------------------------------------------------


@pytest.mark.parametrize("replicas, percent, bound", [
    (1, 50, 1),  # at least one, whatever the percent (Envoy: one is ejected when none is)
    (2, 50, 1),  # the default: one of two, never both
    (3, 50, 1),  # rounded down
    (4, 50, 2),
    (2, 100, 2),
    (3, 100, 3),
    (4, 1, 1),
    (3, 67, 2),  # 2.01
    (3, 66, 1),  # 1.98: down
    (0, 50, 1),
])
def test_the_bound_is_the_percent_rounded_down_but_at_least_one(replicas, percent, bound):
    assert ejection_bound(replicas, percent) == bound
    assert all(may_eject(ejected, replicas, percent) for ejected in range(bound))
    assert not may_eject(bound, replicas, percent)


@pytest.mark.parametrize("percent", [0, 101, -5])
def test_a_percent_out_of_1_to_100_is_refused(percent):
    with pytest.raises(RouterConfigError, match="--max-ejection-percent must be 1-100"):
        plan_router(["http://127.0.0.1:1"],
                    health=HealthConfig(max_ejection_percent=percent))


def test_the_default_bound_is_50_percent():
    assert plan_router(["http://127.0.0.1:1"]).health.max_ejection_percent == 50


def healthy_set(count: int, percent: int = 50) -> tuple[Backends, list[Replica]]:
    replicas = [Replica(str(i), f"http://127.0.0.1:{i + 1}") for i in range(count)]
    for replica in replicas:
        replica.health = Health.HEALTHY
    return Backends(replicas, max_ejection_percent=percent), replicas


def test_records_eject_within_the_bound_and_a_refused_one_whatever_it():
    suppressed: list[tuple[str, Ejected]] = []
    backends_, (a, b, c) = healthy_set(3)
    backends_.on_suppressed = lambda replica, why: suppressed.append((replica.id, why))
    cfg = HealthConfig(failure_threshold=1)
    record_failure(a, cfg, "/health did not answer within 2 s")
    assert a.health is Health.UNHEALTHY and a.ejected_reason is Ejected.FAILURES
    # 1 of 3 is out: the bound (50% of 3, rounded down)
    record_failure(b, cfg, "/health did not answer within 2 s")
    assert not record_hang(c, "no status line within 5 s, and /health did not answer")
    assert (b.health, b.routable, b.ejection_suppressed) == (Health.HEALTHY, True,
                                                              Ejected.FAILURES)
    assert (c.health, c.routable, c.ejection_suppressed) == (Health.HEALTHY, True, Ejected.HANG)
    assert c.num_hangs == 0 and c.num_ejections == 0  # not ejected, so not counted as hung
    assert suppressed == [("1", Ejected.FAILURES), ("2", Ejected.HANG)]
    assert b.describe()["ejection_suppressed"] == "failures"
    assert b.describe()["ejections_suppressed"] == 1
    # b's process is gone: a refused connection ejects it whatever the bound
    record_failure(b, cfg, "connect_error: refused", refused=True)
    assert (b.health, b.ejected_reason, b.ejection_suppressed) == (
        Health.UNHEALTHY, Ejected.REFUSED, None)
    assert backends_.outlier_ejected() == 1  # b does not count: c is still held back
    record_failure(c, cfg, "/health did not answer within 2 s")
    assert c.routable and c.num_suppressed == 2
    # a answers again: c's ejection is no longer due, and a's share is free once re-admitted
    record_success(c, cfg, probe=False)
    assert c.ejection_suppressed is None
    for _ in range(cfg.success_threshold):
        record_success(a, cfg, probe=True)
    assert a.routable and backends_.outlier_ejected() == 0
    record_failure(c, cfg, "/health did not answer within 2 s")
    assert (c.health, c.ejected_reason) == (Health.UNHEALTHY, Ejected.FAILURES)


def test_an_ejected_replica_whose_port_then_refuses_frees_its_share():
    backends_, (a, b) = healthy_set(2)
    cfg = HealthConfig(failure_threshold=1)
    record_failure(a, cfg, "/health answered 500")
    record_failure(b, cfg, "/health answered 500")
    assert b.routable and b.ejection_suppressed is Ejected.FAILURES
    record_failure(a, cfg, "/health failed: refused", refused=True)  # its process died
    assert a.ejected_reason is Ejected.REFUSED and backends_.outlier_ejected() == 0
    record_failure(b, cfg, "/health answered 500")
    assert b.health is Health.UNHEALTHY and b.ejected_reason is Ejected.FAILURES


def test_a_disabled_replica_ejected_does_not_use_the_share():
    """A rolling restart's drained replica answers 503 to its checks and is ejected; it is out
    of rotation by the admin call already, so the other, hanging meanwhile, is ejected too
    (its requests then wait for a replica rather than stay stuck on a stopped process)."""
    backends_, (a, b) = healthy_set(2)
    cfg = HealthConfig(failure_threshold=1)
    a.disabled = True  # PUT /workers: drained before its restart
    record_failure(a, cfg, "/health answered 503")
    assert a.ejected_reason is Ejected.FAILURES and backends_.outlier_ejected() == 0
    assert record_hang(b, "no byte within 5 s, and /health did not answer within 2 s")
    assert b.ejected_reason is Ejected.HANG and b.ejection_suppressed is None
    a.disabled = False  # enabled again before it is re-admitted: it counts from now on
    assert backends_.outlier_ejected() == 2


def test_a_replica_outside_any_set_is_ejected_as_before():
    replica = Replica("a", "http://127.0.0.1:1", health=Health.HEALTHY)
    assert record_hang(replica, "hung")
    assert replica.ejected_reason is Ejected.HANG and replica.num_hangs == 1


def test_a_refused_connection_is_told_from_other_failures():
    async def main():
        async with aiohttp.ClientSession() as session:
            closed = await Backend("closed").start()
            url = closed.url
            await closed.stop()  # the port refuses connections now
            try:
                await session.get(url + "/health")
            except aiohttp.ClientError as exc:
                try:
                    raise RuntimeError("raised while handling it") from None
                except RuntimeError as wrapped:
                    return exc, wrapped
            raise AssertionError("a closed port answered")

    refused, wrapped = run(main())
    assert connection_refused(refused)
    assert connection_refused(wrapped)  # as the proxy raises UpstreamFailed from None
    assert not connection_refused(aiohttp.ServerDisconnectedError())
    assert not connection_refused(asyncio.TimeoutError())
    assert not connection_refused(None)


# --- a flood through a router ----------------------------------------------------------------


@dataclass(eq=False)
class Floodable(Backend):
    """A stand-in replica that, while `flooded`, answers nothing (its /health included) until
    its `release` is set: every replica slow at once, as a burst past what the GPU serves in
    time makes them."""

    flooded: bool = False

    async def _health(self, request: web.Request) -> web.Response:
        if self.flooded:
            await self.release.wait()
        return await super()._health(request)

    def end_flood(self) -> None:
        self.flooded = False
        self.release.set()


async def slow_while_flooded(backend: Floodable, request: web.Request, seen) -> web.Response:
    if backend.flooded:
        await backend.release.wait()
    return web.json_response({"backend": backend.name})


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    status, _, body = await fetch(session, "GET", url + "/workers")
    assert status == 200
    return {w["id"]: w for w in json.loads(body)["workers"]}


def admitted(served, names) -> bool:
    """Every replica found healthy by its first check: flooded before it, a replica stays
    unknown (failed checks eject a healthy one only) and is never decided; a loaded machine
    flooded them before the first check ended."""
    return all(served.replica(name).health is Health.HEALTHY for name in names)


def decided(served, names) -> bool:
    """Every replica was found hung or failing: ejected, or kept in by the bound."""
    replicas = [served.replica(name) for name in names]
    return all(r.health is Health.UNHEALTHY or r.ejection_suppressed is not None
               for r in replicas)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_flood_that_slows_every_replica_past_the_first_byte_timeout_ejects_at_most_the_bound(
        count):
    names = [chr(ord("a") + i) for i in range(count)]
    bound = ejection_bound(count, 50)

    async def main():
        stand_ins = [Floodable(name, slow_while_flooded) for name in names]
        async with backends(*stand_ins):
            config = make_config([f"{s.name}={s.url}" for s in stand_ins],
                                 policy="round_robin", failures=100, **TIMEOUTS)
            async with serve(config) as served, client() as session:
                await until(lambda: admitted(served, names), 10.0, "every replica admitted")
                for stand_in in stand_ins:
                    stand_in.flooded = True
                flood = [asyncio.create_task(fetch(session, "POST", served.url + "/v1/x",
                                                   data=b"{}"))
                         for _ in range(2 * count)]
                await until(lambda: decided(served, names), 10.0,
                            "every replica found hung: ejected or kept in")
                during = await workers(session, served.url)
                ready, _, ready_body = await fetch(session, "GET", served.url + "/ready")
                for stand_in in stand_ins:
                    stand_in.end_flood()
                results = await asyncio.gather(*flood)
                await served.wait_idle()
                return during, ready, json.loads(ready_body), results, await scrape(
                    session, served.url)

    during, ready, ready_body, results, metrics = run(main())
    ejected = [w for w in during.values() if w["health"] == "unhealthy"]
    kept = [w for w in during.values() if w["health"] == "healthy"]
    assert len(ejected) == bound, during
    assert all(w["ejected_reason"] == "hang" and not w["routable"] for w in ejected)
    assert len(kept) == count - bound
    assert all(w["routable"] and w["ejection_suppressed"] == "hang"
               and w["ejections_suppressed"] >= 1 for w in kept), kept
    assert (ready, ready_body["routable_replicas"]) == (200, count - bound)
    # every request of the flood answered, by a replica kept in
    assert [status for status, _, _ in results] == [200] * (2 * count)
    assert {headers["X-Omni-DP-Replica"] for _, headers, _ in results} <= {
        w["id"] for w in kept}
    assert sample(metrics, "omni_dp_router_ejections_suppressed_total",
                  reason="hang") >= count - bound
    assert sum(sample(metrics, "omni_dp_router_hangs_total", replica=name)
               for name in names) == bound


def with_percent(config, percent: int):
    return dataclasses.replace(
        config, health=dataclasses.replace(config.health, max_ejection_percent=percent))


def test_with_the_bound_at_100_percent_a_flood_ejects_every_replica():
    """What the bound prevents: every replica found hung is ejected, none is left to route to
    (the router then makes requests wait for one, --replica-wait)."""
    names = ["a", "b"]

    async def main():
        stand_ins = [Floodable(name, slow_while_flooded) for name in names]
        async with backends(*stand_ins):
            config = with_percent(make_config([f"{s.name}={s.url}" for s in stand_ins],
                                              policy="round_robin", failures=100,
                                              replica_wait_s=0.0, **TIMEOUTS), 100)
            async with serve(config) as served, client() as session:
                await until(lambda: admitted(served, names), 10.0, "every replica admitted")
                for stand_in in stand_ins:
                    stand_in.flooded = True
                flood = [asyncio.create_task(fetch(session, "POST", served.url + "/v1/x",
                                                   data=b"{}")) for _ in range(4)]
                await until(lambda: decided(served, names), 10.0, "both found hung")
                results = await asyncio.gather(*flood)
                for stand_in in stand_ins:
                    stand_in.end_flood()
                await served.wait_idle()
                return await workers(session, served.url), results

    listed, results = run(main())
    assert {w["health"] for w in listed.values()} == {"unhealthy"}
    assert all(w["ejection_suppressed"] is None for w in listed.values())
    assert all(status >= 500 for status, _, _ in results), results  # nothing to send them to


def test_slow_health_checks_eject_one_of_two_and_its_readmission_frees_the_bound():
    """Active checks that time out under a flood (--health-failures in a row) eject one
    replica; the other stays routable, kept in by the bound, until the first is re-admitted:
    then its next failed check ejects it."""

    async def main():
        a, b = Floodable("a"), Floodable("b")
        async with backends(a, b):
            config = make_config([f"a={a.url}", f"b={b.url}"], interval=0.1, failures=2,
                                 successes=1, health_timeout=0.3)
            async with serve(config) as served, client() as session:
                await until(lambda: admitted(served, ["a", "b"]), 10.0, "both admitted")
                a.flooded = b.flooded = True
                await until(lambda: decided(served, ["a", "b"]), 10.0,
                            "both failed their checks")
                during = await workers(session, served.url)
                out = next(name for name, w in during.items() if w["health"] == "unhealthy")
                kept = "b" if out == "a" else "a"
                # the ejected one answers again: re-admitted, it frees its share of the bound
                {"a": a, "b": b}[out].end_flood()
                await until(lambda: served.replica(kept).health is Health.UNHEALTHY, 10.0,
                            f"{kept} ejected once {out} came back")
                after = await workers(session, served.url)
                {"a": a, "b": b}[kept].end_flood()
                return during, out, kept, after, await scrape(session, served.url)

    during, out, kept, after, metrics = run(main())
    assert during[out]["ejected_reason"] == "failures" and not during[out]["routable"]
    assert during[kept]["routable"] and during[kept]["ejection_suppressed"] == "failures"
    assert "/health did not answer within 0.3 s" in during[kept]["last_error"]
    assert after[out]["routable"] and after[out]["generation"] == 2
    assert after[kept]["ejected_reason"] == "failures" and not after[kept]["routable"]
    assert after[kept]["ejection_suppressed"] is None
    assert sample(metrics, "omni_dp_router_ejections_suppressed_total",
                  reason="failures") >= 1


# --- a dead replica leaves the rotation, whatever the bound ------------------------------------


def test_a_replica_whose_port_closes_is_ejected_by_its_checks_whatever_the_bound():
    async def main():
        a, b = Backend("a"), Backend("b")
        async with backends(a, b):
            config = make_config([f"a={a.url}", f"b={b.url}"], interval=0.1, failures=2,
                                 successes=1)
            async with serve(config) as served, client() as session:
                a.health_status = 500  # a fails its checks: ejected, the bound is spent
                await until(lambda: served.replica("a").health is Health.UNHEALTHY, 10.0,
                            "a ejected")
                await b.stop()  # b's process is gone: its port refuses connections
                await until(lambda: served.replica("b").health is Health.UNHEALTHY, 10.0,
                            "b ejected although a is out")
                return await workers(session, served.url)

    listed = run(main())
    assert listed["a"]["ejected_reason"] == "failures"
    assert (listed["b"]["ejected_reason"], listed["b"]["routable"]) == ("refused", False)
    assert listed["b"]["ejections_suppressed"] == 0
    assert "ClientConnectorError" in listed["b"]["last_error"]


async def bad_gateway(backend: Backend, request: web.Request, seen) -> web.Response:
    return web.json_response({"backend": backend.name}, status=502)


def test_a_refused_connection_while_proxying_ejects_whatever_the_bound():
    """No active checks here: the proxy's own refused connection to b takes it out, though a
    (ejected for a 502) spent the bound; the request finds no replica left (no wait: 503)."""

    async def main():
        a, b = Backend("a", bad_gateway), Backend("b")
        async with backends(a, b):
            config = make_config([f"a={a.url}", f"b={b.url}"], failures=1,
                                 policy="round_robin", replica_wait_s=0.0)
            async with serve(config) as served, client() as session:
                for _ in range(2):  # round robin: one of the two goes to a
                    await fetch(session, "POST", served.url + "/v1/x", data=b"{}")
                assert served.replica("a").ejected_reason is Ejected.FAILURES
                await b.stop()
                status, _, _ = await fetch(session, "POST", served.url + "/v1/x", data=b"{}")
                ready, _, _ = await fetch(session, "GET", served.url + "/ready")
                await served.wait_idle()
                return status, ready, await workers(session, served.url)

    status, ready, listed = run(main())
    assert (listed["b"]["ejected_reason"], listed["b"]["routable"]) == ("refused", False)
    assert listed["b"]["ejections_suppressed"] == 0
    assert status >= 500 and ready == 503  # nothing left to send to
