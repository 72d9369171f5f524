"""Shared pieces of the router tests: trivial aiohttp replicas and a router, all on loopback
(free ports: support.ports; waiting in the loop: support.wait.until; the client:
support.http_client.client and fetch).

Everything runs inside one `asyncio.run` per test (no pytest-asyncio): the backends, the router
and the client share the loop, so a test can gate a backend on an `asyncio.Event` that the client
side sets, instead of relying on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from omni_dp.router.app import Router, make_runner
from omni_dp.router.config import HealthConfig, plan_router

from support.http_client import fetch
from support.ports import LOOPBACK
from support.wait import until

TEST_TIMEOUT_S = 20.0  # every asyncio.run in these tests is bounded by this


def run(coro: Awaitable, uvloop: bool = False) -> object:
    """Run one test's coroutine, bounded: a hang fails the test instead of the suite.

    `uvloop=True` runs it on uvloop, the loop `omni-dp router` itself uses when installed.
    """

    async def bounded():
        return await asyncio.wait_for(coro, TEST_TIMEOUT_S)

    if uvloop:
        import uvloop as _uvloop

        return _uvloop.run(bounded())
    return asyncio.run(bounded())


def make_config(urls: list[str], *, interval: float = 30.0, failures: int = 3,
                successes: int = 2, health_timeout: float = 2.0, **options):
    """A validated config; the health interval is long unless a test needs active checks."""
    health = HealthConfig(interval_s=interval, timeout_s=health_timeout,
                          failure_threshold=failures, success_threshold=successes, jitter=0.0)
    options.setdefault("seed", 1234)
    options.setdefault("port", 0)
    return plan_router(urls, health=health, **options)


# --- backends ----------------------------------------------------------------------------------


@dataclass
class Seen:
    """One request as a backend received it."""

    method: str
    raw_path: str  # the request target as sent, query included
    headers: CIMultiDict
    body: bytes


Handler = Callable[["Backend", web.Request, Seen], Awaitable[web.StreamResponse]]


async def echo(backend: Backend, request: web.Request, seen: Seen) -> web.StreamResponse:
    return web.json_response({"backend": backend.name, "path": seen.raw_path})


async def hold_if_asked(backend: Backend, request: web.Request, seen: Seen) -> web.Response:
    """`?hold=1` waits for `backend.release`; `?status=N` answers N (default 200)."""
    if "hold=1" in seen.raw_path:
        await backend.release.wait()
    status = int(request.query.get("status", "200"))
    return web.json_response({"backend": backend.name}, status=status)


async def status_from_query(backend: Backend, request: web.Request, seen: Seen) -> web.Response:
    """Answers `?status=N` (default 200) with the body {"status": N}."""
    status = int(request.query.get("status", "200"))
    return web.json_response({"status": status}, status=status)


@dataclass(eq=False)
class Backend:
    """An aiohttp server on 127.0.0.1:0 standing in for one replica.

    `/health` answers `health_status` and counts probes; every other path is recorded in
    `seen` and answered by `handler`. `arrived` is set whenever a request arrives.
    """

    name: str = "backend"
    handler: Handler = echo
    cancellation: bool = False  # handler_cancellation for this server
    health_status: int = 200
    health_probes: int = 0
    on_probe: Callable[[Backend], None] | None = None
    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # for handlers that hold
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    async def start(self, port: int = 0) -> Backend:
        app = web.Application(client_max_size=1024**3)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=self.cancellation,
                                     access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Close the listener and every connection: the port refuses connections afterwards."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        if self.on_probe is not None:
            self.on_probe(self)
        return web.json_response({"status": "ok"}, status=self.health_status)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.raw_path, CIMultiDict(request.headers),
                    await request.read())
        self.seen.append(seen)
        return await self.handler(self, request, seen)


@contextlib.asynccontextmanager
async def backends(*specs: Backend | str):
    """Start backends (a name gives an echo backend) and stop them all afterwards."""
    started = [spec if isinstance(spec, Backend) else Backend(spec) for spec in specs]
    try:
        for backend in started:
            await backend.start()
        yield started
    finally:
        for backend in started:
            await backend.stop()


# --- the router ----------------------------------------------------------------------------------


@dataclass
class Served:
    router: Router
    url: str

    def replica(self, replica_id: str):
        replica = self.router.replicas.get(replica_id)
        assert replica is not None, replica_id
        return replica

    def in_flight(self) -> dict[str, int]:
        return {r.id: r.in_flight for r in self.router.replicas}

    def never_negative(self) -> None:
        """Assert that no in-flight count ever went below zero (a slot released twice)."""
        router = self.router
        lowest = {"admitted": router.lowest_admitted, "reading": router.lowest_reading}
        lowest.update({f"replica {r.id}": r.lowest_in_flight for r in router.replicas})
        assert all(value == 0 for value in lowest.values()), f"counts went negative: {lowest}"

    def idle(self) -> bool:
        """Every count back at exactly 0; an AssertionError at once if one ever went below."""
        self.never_negative()
        router = self.router
        return (router.num_admitted == 0 and router.num_reading == 0
                and all(r.in_flight == 0 for r in router.replicas))

    async def wait_idle(self, timeout: float = 3.0) -> None:
        await until(self.idle, timeout, f"router idle (in flight {self.in_flight()}, "
                                        f"admitted {self.router.num_admitted}, "
                                        f"reading {self.router.num_reading})")


@contextlib.asynccontextmanager
async def serve(config, middlewares: tuple = ()):
    """The router as `omni-dp router` runs it (handler cancellation on), on 127.0.0.1:0.

    `middlewares` go in front of the router's own (to fake a client address, say).
    """
    router = Router(config)
    await router.start()
    runner = None
    try:
        runner = make_runner(router, shutdown_timeout=1.0)
        for index, middleware in enumerate(middlewares):
            runner.app.middlewares.insert(index, middleware)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        yield Served(router, f"http://{LOOPBACK}:{runner.addresses[0][1]}")
    finally:
        if runner is not None:
            await runner.cleanup()
        await router.stop()


async def replica_of(session: aiohttp.ClientSession, url: str, **kwargs) -> str:
    """Send one GET; return the replica id the router says served it (asserting a 200)."""
    status, headers, body = await fetch(session, "GET", url, **kwargs)
    assert status == 200, body
    return headers["X-Omni-DP-Replica"]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple, float]:
    """/metrics as {(sample name, sorted label items): value}."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict[tuple, float], name: str, **labels) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict[tuple, float], name: str, **labels) -> float:
    """The sum of every sample of `name` whose labels include `labels` (0 when none)."""
    wanted = set(labels.items())
    return sum(value for (sample_name, items), value in samples.items()
               if sample_name == name and wanted <= set(items))


def error_body(body: bytes) -> dict:
    """The OpenAI-style error object of a router error response."""
    parsed = json.loads(body)
    assert set(parsed) == {"error"}, parsed
    assert {"message", "type", "code"} <= set(parsed["error"]), parsed
    return parsed["error"]


async def read_all(session: aiohttp.ClientSession, url: str, *,
                   data: bytes = b'{"input": "x"}', headers: dict | None = None) -> tuple:
    """POST and read the answer as it comes: (status, headers, body, the error that broke it
    or None) — a stream cut before its end shows as a ClientPayloadError, never a short 200."""
    async with session.post(url, data=data, headers=headers or {}) as resp:
        body, broken = b"", None
        try:
            async for chunk in resp.content.iter_any():
                body += chunk
        except aiohttp.ClientPayloadError as exc:
            broken = exc
        return resp.status, resp.headers, body, broken


def routes(caplog) -> dict[str, dict]:
    """The router's route lines a test captured, by request id."""
    return {line["request_id"]: line for line in (
        json.loads(r.getMessage()) for r in caplog.records if r.name == "omni_dp.router.access")}
