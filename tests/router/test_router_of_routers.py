"""A second `omni-dp router` in front of several hosts' routers (the no-gateway option).

Two "host" routers, each over two stand-in replicas (support.router's Backend, in the test's
loop), and one front router over the two host routers: all three are real `omni-dp router`
processes started through the CLI on loopback and stopped by pid. The front sees each host
router as one replica: it checks the host's `GET /health` (200 only while the host has a
routable replica), relays the host's answers as they are (a host's admission 503 included),
and counts per host.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from support.http_client import fetch
from support.ports import LOOPBACK, free_ports
from support.router import Backend, echo, hold_if_asked, run, sample, scrape, total
from support.router_process import RouterProcess
from support.wait import until

# Fast checks, so a host leaves and rejoins the front's rotation within a second or so.
HEALTH = ("--health-interval", "0.1", "--health-timeout", "0.5", "--health-failures", "2",
          "--health-successes", "1", "--health-jitter", "0")
NOTICE_S = 3.0  # the bound on the front (or a host) noticing a change of health


class Fleet:
    """Hosts `a` and `b` (routers over backends a0, a1 and b0, b1) behind one front router."""

    def __init__(self, tmp_path: Path, handler, host_b_args: tuple[str, ...] = (),
                 front_args: tuple[str, ...] = (), every_args: tuple[str, ...] = ()) -> None:
        self.backends = {name: Backend(name, handler) for name in ("a0", "a1", "b0", "b1")}
        self.tmp_path = tmp_path
        self.host_b_args = (*every_args, *host_b_args)
        self.host_a_args = every_args
        self.front_args = (*every_args, *front_args)
        self.headers = {"X-API-Key": every_args[every_args.index("--api-key") + 1]} \
            if "--api-key" in every_args else {}
        self.hosts: dict[str, RouterProcess] = {}
        self.front: RouterProcess | None = None

    async def __aenter__(self) -> Fleet:
        try:
            for backend in self.backends.values():
                await backend.start()
            ports = free_ports(3)
            for host, port, extra in (("a", ports[0], self.host_a_args),
                                      ("b", ports[1], self.host_b_args)):
                replicas = [arg for i in (0, 1) for arg in
                            ("--replica", f"{host}{i}={self.backends[f'{host}{i}'].url}")]
                self.hosts[host] = RouterProcess(self.tmp_path / f"host_{host}.log", *HEALTH,
                                                 *replicas, *extra, port=port)
            # The command docs/deployment.md gives: the host routers are the front's replicas.
            self.front = RouterProcess(
                self.tmp_path / "front.log", *HEALTH, "--replica", f"a={self.hosts['a'].url}",
                "--replica", f"b={self.hosts['b'].url}", *self.front_args, port=ports[2])
            routers = [*self.hosts.values(), self.front]
            for router in routers:  # all three start together: the front waits for none
                await router.start()
            for router in routers:
                await router.wait_listening()
            await self.wait_front(lambda w: w["a"]["routable"] and w["b"]["routable"],
                                  "both hosts routable at the front")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        for backend in self.backends.values():
            backend.release.set()
        for router in [self.front, *self.hosts.values()]:
            if router is not None:
                await router.killed()
        for backend in self.backends.values():
            await backend.stop()

    def seen(self) -> dict[str, int]:
        return {name: len(b.seen) for name, b in self.backends.items()}

    async def workers(self, router: RouterProcess | None = None) -> dict:
        async with session() as client:
            status, _, body = await fetch(client, "GET", (router or self.front).url + "/workers",
                                          headers=self.headers)
        assert status == 200, body
        return json.loads(body)

    async def wait_front(self, check, what: str, timeout: float = NOTICE_S) -> float:
        """Poll the front's /workers until check({id: W}) holds; the seconds it took."""
        started = deadline = time.monotonic()
        deadline += timeout
        while True:
            listing = await self.workers()
            if check({w["id"]: w for w in listing["workers"]}):
                return time.monotonic() - started
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {listing}"
            await asyncio.sleep(0.02)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))


async def speech(client: aiohttp.ClientSession, url: str, query: str = "", **kwargs):
    return await fetch(client, "POST", url + "/v1/audio/speech" + query, data=b'{"input": "x"}',
                       **kwargs)


def test_requests_spread_over_both_hosts_and_reach_all_four_replicas(tmp_path):
    async def main():
        async with Fleet(tmp_path, echo) as fleet, session() as client:
            results = await asyncio.gather(*(speech(client, fleet.front.url) for _ in range(40)))
            listing = await fleet.workers()
            metrics = await scrape(client, fleet.front.url)
            return results, fleet.seen(), listing, metrics

    results, seen, listing, metrics = run(main())
    assert [status for status, _, _ in results] == [200] * 40
    by_host = [headers["X-Omni-DP-Replica"] for _, headers, _ in results]
    assert {"a", "b"} == set(by_host)
    assert all(count > 0 for count in seen.values()), seen
    assert sum(seen.values()) == 40
    # the front counts per host: the host routers are its replicas
    for host in ("a", "b"):
        assert sample(metrics, "omni_dp_router_requests_total", replica=host,
                      status="200") == by_host.count(host)
        assert sample(metrics, "omni_dp_router_replica_routable", replica=host) == 1
    # GET /workers on the front: each host with its state
    workers = {w["id"]: w for w in listing["workers"]}
    assert set(workers) == {"a", "b"}
    for host, w in workers.items():
        assert w["health"] == "healthy" and w["routable"] is True and w["disabled"] is False
        assert w["in_flight"] == 0 and w["requests"] == by_host.count(host)
        assert w["url"].startswith(f"http://{LOOPBACK}:")
    assert (listing["ready"], listing["stopping"], listing["routable_replicas"]) == (True, False, 2)
    # defaults: 256 per replica (here, per host), times 2
    assert (listing["max_inflight"], listing["max_inflight_per_replica"]) == (512, 256)


def test_a_host_whose_replicas_are_all_down_leaves_the_front_and_comes_back(tmp_path):
    """Both of host a's replicas stop: host a's /health turns 503, the front takes a out, every
    request then goes to b; a's replicas come back on the same ports, and so does a."""

    async def main():
        async with Fleet(tmp_path, echo) as fleet, session() as client:
            host_a, a0, a1 = fleet.hosts["a"], fleet.backends["a0"], fleet.backends["a1"]
            ports = a0.port, a1.port
            # Traffic runs all along, as it would: one client, back to back.
            log: list[tuple[float, int, str | None]] = []
            stop_traffic = asyncio.Event()

            async def traffic():  # each request logged with the time it was sent
                while not stop_traffic.is_set():
                    sent = time.monotonic()
                    try:
                        status, headers, _ = await speech(client, fleet.front.url)
                        log.append((sent, status, headers.get("X-Omni-DP-Replica")))
                    except aiohttp.ClientError:
                        log.append((sent, 0, None))
                    await asyncio.sleep(0.005)

            task = asyncio.create_task(traffic())
            try:
                await until(lambda: len(log) >= 10, 5, "traffic")
                stopped_at = time.monotonic()
                await a0.stop()
                await a1.stop()
                noticed_s = await fleet.wait_front(lambda w: not w["a"]["routable"],
                                                   "the front ejecting host a")
                noticed_at = time.monotonic()
                health_a, _, body_a = await fetch(client, "GET", host_a.url + "/health")
                await until(lambda: sum(1 for t, _, _ in log if t > noticed_at) >= 20, 5,
                            "20 requests after the front noticed")
                front_view = (await fleet.workers())
                seen_while_out = sum(len(b.seen) for b in (a0, a1))

                await a0.start(ports[0])
                await a1.start(ports[1])
                back_at = time.monotonic()
                back_s = await fleet.wait_front(lambda w: w["a"]["routable"],
                                                "the front re-admitting host a")
                await until(lambda: len(a0.seen) + len(a1.seen) > seen_while_out, 5,
                            "host a serving again")
            finally:
                stop_traffic.set()
                await task
            window = [(s, r) for t, s, r in log if stopped_at <= t <= noticed_at]  # sent in it
            after = [(s, r) for t, s, r in log if noticed_at < t < back_at]
            return (health_a, json.loads(body_a), noticed_s, back_s, window, after, front_view)

    health_a, body_a, noticed_s, back_s, window, after, front_view = run(main())
    assert health_a == 503 and body_a["routable_replicas"] == 0
    assert noticed_s < NOTICE_S and back_s < NOTICE_S
    # After the front noticed: every request answered by host b.
    assert len(after) >= 20
    assert all(status == 200 and replica == "b" for status, replica in after), after
    a = {w["id"]: w for w in front_view["workers"]}["a"]
    assert a["health"] == "unhealthy" and a["routable"] is False and a["ejections"] >= 1
    print(f"\nhost a out: noticed in {noticed_s:.3f} s, back in {back_s:.3f} s; "
          f"in the window {len(window)} request(s), failed: "
          f"{[s for s, _ in window if s != 200]}")


def test_a_host_with_every_replica_disabled_leaves_the_front_under_traffic(tmp_path):
    """Host a's replicas are all disabled (drained by its operator): host a answers 503 to
    requests and to /health. Steady traffic must not keep it in the front's rotation: a 503
    answer is no proof of health, so it must not undo the failed checks."""

    async def main():
        async with Fleet(tmp_path, echo) as fleet, session() as client:
            host_a = fleet.hosts["a"]
            log: list[tuple[float, int, str | None]] = []
            stop_traffic = asyncio.Event()

            async def traffic():  # each request logged with the time it was sent
                while not stop_traffic.is_set():
                    sent = time.monotonic()
                    status, headers, _ = await speech(client, fleet.front.url)
                    log.append((sent, status, headers.get("X-Omni-DP-Replica")))

            task = asyncio.create_task(traffic())
            try:
                await until(lambda: len(log) >= 10, 5, "traffic")
                for name in ("a0", "a1"):
                    status, _, _ = await fetch(client, "PUT", f"{host_a.url}/workers/{name}",
                                               json={"disabled": True})
                    assert status == 200
                noticed_s = await fleet.wait_front(lambda w: not w["a"]["routable"],
                                                   "the front ejecting host a")
                noticed_at = time.monotonic()
                await until(lambda: sum(1 for t, _, _ in log if t > noticed_at) >= 20, 5,
                            "20 requests after the front noticed")
            finally:
                stop_traffic.set()
                await task
            return noticed_s, [(s, r) for t, s, r in log if t > noticed_at]

    noticed_s, after = run(main())
    assert noticed_s < NOTICE_S
    assert all(status == 200 and replica == "b" for status, replica in after), after
    print(f"\nhost a drained: out of the front's rotation in {noticed_s:.3f} s")


def test_a_full_host_answers_503_with_retry_after_through_the_front_and_stays_healthy(tmp_path):
    """Host b admits 2 requests in flight. Saturated (by clients of its own), it answers the
    front's requests 503 + Retry-After at once; the front relays that, does not retry it
    elsewhere, and keeps b healthy. With the front's per-host bound at the hosts' bound, the
    front itself refuses once both hosts are full, before sending anything."""

    async def main():
        async with Fleet(tmp_path, hold_if_asked, host_b_args=("--max-inflight", "2"),
                         front_args=("--max-inflight-per-replica", "2")) as fleet, \
                session() as client:
            host_b = fleet.hosts["b"]
            # b is full with 2 held requests that did not come through the front.
            held = [asyncio.create_task(speech(client, host_b.url, "?hold=1")) for _ in (0, 1)]
            await until(lambda: fleet.seen()["b0"] + fleet.seen()["b1"] == 2, 5, "b full")
            answers = []
            for _ in range(8):
                started = time.monotonic()
                status, headers, body = await speech(client, fleet.front.url)
                answers.append((status, headers.get("X-Omni-DP-Replica"),
                                headers.get("Retry-After"), time.monotonic() - started, body))
            await asyncio.sleep(0.5)  # five check intervals while b is still full
            b_full = {w["id"]: w for w in (await fleet.workers())["workers"]}["b"]
            fleet.backends["b0"].release.set()
            fleet.backends["b1"].release.set()
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
            fleet.backends["b0"].release.clear()
            fleet.backends["b1"].release.clear()

            # Now through the front only: 4 held requests fill both hosts (2 each) ...
            held = [asyncio.create_task(speech(client, fleet.front.url, "?hold=1"))
                    for _ in range(4)]
            await fleet.wait_front(lambda w: w["a"]["in_flight"] == 2 and w["b"]["in_flight"] == 2,
                                   "2 requests in flight at each host")
            # ... and the front answers the next one itself.
            started = time.monotonic()
            status, headers, body = await speech(client, fleet.front.url)
            front_full = (status, headers.get("X-Omni-DP-Replica"), headers.get("Retry-After"),
                          time.monotonic() - started, json.loads(body))
            for backend in fleet.backends.values():
                backend.release.set()
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200] * 4
            metrics = await scrape(client, fleet.front.url)
            return answers, b_full, front_full, metrics, await fleet.workers(host_b)

    answers, b_full, front_full, metrics, host_b = run(main())
    from_b = [a for a in answers if a[1] == "b"]
    from_a = [a for a in answers if a[1] == "a"]
    assert from_b and from_a, answers
    assert all(status == 200 for status, *_ in from_a)
    for status, _, retry_after, seconds, body in from_b:
        assert status == 503 and retry_after == "1"
        assert json.loads(body)["error"]["type"] == "router_full"
        assert seconds < 1.0
    assert b_full["health"] == "healthy" and b_full["routable"] is True
    assert b_full["consecutive_failures"] == 0 and b_full["ejections"] == 0
    assert sample(metrics, "omni_dp_router_requests_total", replica="b", status="503") == len(
        from_b)
    assert total(metrics, "omni_dp_router_retries_total") == 0
    status, replica, retry_after, seconds, body = front_full
    assert (status, replica, retry_after) == (503, None, "1")
    # its own bound is 2 per host × 2 hosts = 4, all taken: refused before any host is asked
    assert body["error"]["type"] == "router_full" and seconds < 1.0
    # what the front's per-host bound should follow: the host's own, on its /workers
    assert (host_b["max_inflight"], host_b["in_flight"], host_b["ready"]) == (2, 0, True)
    print(f"\nb full: 503 through the front in "
          f"{max(s for *_, s, _ in from_b) * 1000:.1f} ms at most; the front full: "
          f"{seconds * 1000:.1f} ms")


def test_a_stream_crosses_both_hops_chunk_by_chunk_with_one_request_id_and_key(tmp_path):
    """The replica sends its first event, then waits until the client has it before sending
    the last: a hop that buffered would hang here. Every router has the same --api-key: the
    client's key goes through both hops, and the checks of /health need none."""
    client_has_first = asyncio.Event()
    timings = {}

    async def stream(backend: Backend, request: web.Request, seen) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        timings.setdefault("first_sent", time.monotonic())
        await response.write(b'data: {"n": 1}\n\n')
        await asyncio.wait_for(client_has_first.wait(), 3)
        await response.write(b'data: {"n": 2}\n\n')
        await response.write_eof()
        return response

    async def main():
        async with Fleet(tmp_path, stream, every_args=("--api-key", "k-two-hops")) as fleet, \
                session() as client:
            keyless, _, _ = await fetch(client, "POST", fleet.front.url + "/x", data=b"{}")
            key = {"Authorization": "Bearer k-two-hops"}
            async with client.post(fleet.front.url + "/v1/audio/speech", data=b"{}",
                                   headers={"X-Request-ID": "rid-two-hops", **key}) as resp:
                headers = resp.headers.copy()
                first = await resp.content.readline()
                timings["first_received"] = time.monotonic()
                client_has_first.set()
                rest = await resp.content.read()
            # no request id from the client: the front makes one, and it goes all the way
            status, generated, _ = await fetch(client, "POST", fleet.front.url + "/x",
                                               data=b"{}", headers=key)
            seen = [s for b in fleet.backends.values() for s in b.seen]
            # the route line of each hop names the request
            hops = (fleet.front, fleet.hosts[headers["X-Omni-DP-Replica"]])
            await until(lambda: all('"request_id":"rid-two-hops"' in r.log_text() for r in hops),
                        3, "the route lines of both hops")
            return keyless, headers, first, rest, status, generated, seen

    keyless, headers, first, rest, status, generated, seen = run(main())
    assert keyless == 401
    assert first == b'data: {"n": 1}\n'
    assert rest == b'\ndata: {"n": 2}\n\n'
    assert headers["X-Request-ID"] == "rid-two-hops"
    assert headers["Content-Type"] == "text/event-stream"
    assert status == 200
    assert [s.headers["X-Request-ID"] for s in seen] == ["rid-two-hops",
                                                         generated["X-Request-ID"]]
    assert [s.headers["Authorization"] for s in seen] == ["Bearer k-two-hops"] * 2
    print(f"\nfirst event, replica to client over two hops: "
          f"{(timings['first_received'] - timings['first_sent']) * 1000:.1f} ms")
