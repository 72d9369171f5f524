"""One router process: the Router object, its aiohttp application, and its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import signal
import socket
import sys
from collections.abc import Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from omni_dp.contract import Priority
from omni_dp.router.config import RouterConfig, is_loopback_address
from omni_dp.router.exchange import Exchange, RouteRecord
from omni_dp.router.hangs import HangWatch
from omni_dp.router.health import HealthChecker, check, mark_healthy, probe, record_hang
from omni_dp.router.metrics import RouterMetrics
from omni_dp.router.policies import RequestContext, make_policy
from omni_dp.router.proxy import CLIENT_AUTO_HEADERS, Forwarder, json_error
from omni_dp.router.queues import GRANTED, STOPPING, ClassQueues
from omni_dp.router.relay import ReplicaAdded, ReplicaRemoved, ReplicaUpdated, SiblingChange
from omni_dp.router.replicas import (
    Backends,
    DuplicateReplica,
    Replica,
    ReplicaError,
    released,
    validate_id,
    validate_url,
)
from omni_dp.router.speech_stream import SpeechStreamProxy
from omni_dp.speech_stream import SPEECH_STREAM_PATH
from omni_dp.tracing import ROUTER_SERVICE, Tracer, start_tracing

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

log = logging.getLogger("omni_dp.router")

OPS_PATHS = frozenset({"/health", "/ready", "/live", "/metrics"})
# Only reading the router's own ops endpoints is exempt from --api-key; any other method on
# those paths goes to a replica, so it needs the key like every other proxied request.
OPS_METHODS = frozenset({"GET", "HEAD"})
# After the router's own drain cut (which ends SSE streams with an error event), aiohttp gets
# this long before its shutdown cancels handlers and closes their transports outright.
_CUT_GRACE_S = 1.0
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
ADMIN_PREFIX = "/workers"
# With several workers, how often each writes its replica gauges for its siblings' scrapes.
_SHARED_METRICS_S = 1.0


class _Slot:
    """One of a Router's counted slots held by the current task: the count (`num_reading`,
    `num_admitted`) and the lowest it has been; `cut_off`: a slot whose holder cancelled while
    the router cuts off is counted in num_cut_off. A class, not a generator context manager,
    as it is taken on every request. An in-flight slot given back goes to the class queues
    (`cut_off` marks those)."""

    __slots__ = ("_count", "_cut_off", "_lowest", "_router", "_task")

    def __init__(self, router: Router, count: str, lowest: str, *, cut_off: bool) -> None:
        self._router, self._count, self._lowest, self._cut_off = router, count, lowest, cut_off
        self._task: asyncio.Task | None = None

    def __enter__(self) -> None:
        router = self._router
        self._task = asyncio.current_task()
        setattr(router, self._count, getattr(router, self._count) + 1)
        router._active.add(self._task)

    def __exit__(self, kind, exc, tb) -> None:
        router = self._router
        if (self._cut_off and router.cutting_off and kind is not None
                and issubclass(kind, asyncio.CancelledError)):
            router.num_cut_off += 1
        left = getattr(router, self._count) - 1
        setattr(router, self._count, left)
        setattr(router, self._lowest, min(getattr(router, self._lowest), left))
        released(self._count, left)
        router._active.discard(self._task)
        if self._cut_off:
            router.grant()


class Router:
    """Owns the backends, the policy, the upstream session and the counters."""

    def __init__(self, config: RouterConfig, metrics_dir: str | None = None) -> None:
        """`metrics_dir`: this is one of several worker processes sharing their metrics there
        (metrics.py)."""
        self.config = config
        self.replicas = Backends([Replica(rid, url) for rid, url in config.replicas],
                                 max_ejection_percent=config.health.max_ejection_percent)
        self.policy = make_policy(config.policy, config.seed)
        self.metrics = RouterMetrics(lambda: self.replicas, metrics_dir)
        self.tracer: Tracer | None = None  # --otlp-traces-endpoint (serve_router starts it)
        self.replicas.on_suppressed = self.metrics.count_suppressed
        self._metrics_writer: asyncio.Task | None = None
        self.num_admitted = 0  # requests past admission and not yet answered
        self.num_reading = 0  # requests whose body is being read (before admission)
        self.num_waiting = 0  # admitted requests waiting for a replica to go to (find_replica)
        # Priority classes: the class of a request that names none, the queues for in-flight
        # slots, and the slots handed to queued requests that have not taken them yet.
        self.priority_rules = config.priority_rules()
        self.queues = ClassQueues(self.metrics.set_queue_depth)
        self.num_granted = 0
        # The attempts of bulk requests, run as tasks of their own so that one can be taken
        # back (cancelled) for an interactive request that waits: task -> its Exchange.
        self.bulk_attempts: dict[asyncio.Task, Exchange] = {}
        # The lowest each count ever reached: below 0 means a slot was released twice (a bug,
        # logged as one; the tests check both stay at 0).
        self.lowest_admitted = 0
        self.lowest_reading = 0
        # Shutdown: the loop time the drain ends at; at it, `cutting_off` is set and every
        # request still being read or in flight is cancelled (`num_cut_off` counts the
        # admitted ones).
        self.drain_s: float | None = None
        self.drain_deadline: float | None = None
        self.cutting_off = False
        self.num_cut_off = 0
        self._active: set[asyncio.Task] = set()  # the tasks of reading and admitted requests
        self._cut_timer: asyncio.TimerHandle | None = None
        self.session: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.hangs: HangWatch | None = None
        self.stopping = False
        # Called with each admin change made here, so sibling router processes can apply it.
        self.on_change: Callable[[SiblingChange], None] = lambda change: None

    # --- admission and selection -------------------------------------------------------
    def admission_problem(self, priority: Priority = Priority.DEFAULT) -> tuple[str, str] | None:
        """(reason, message) when a new request must be refused now; None to admit it, or to
        queue it for a slot (`may_enter` says which)."""
        if self.stopping:
            return "stopping", "the router is shutting down; retry"
        if not self.may_enter(priority):
            problem = self._queue_problem(priority)
            if problem is not None:
                return problem
        routable = self.replicas.routable()
        if not routable:
            if self.config.replica_wait_s > 0:
                return None  # it waits for one, in its in-flight slot (find_replica)
            return "no_routable_replica", "no healthy, enabled replica; retry shortly"
        cap = self.config.max_inflight_per_replica
        if all(r.in_flight >= cap for r in routable):
            return "replicas_full", f"every replica has {cap} requests in flight; retry shortly"
        return None

    def slot_limit(self, priority: Priority) -> int:
        """The in-flight requests past which one of this class gets no slot: the bound, less
        --reserved-interactive for the other classes (one slot always stays theirs)."""
        bound = self.config.inflight_bound(len(self.replicas))
        if priority is Priority.INTERACTIVE:
            return bound
        return bound - min(self.config.reserved_interactive, bound - 1)

    def has_slot(self, priority: Priority) -> bool:
        return self.num_admitted + self.num_granted < self.slot_limit(priority)

    def may_enter(self, priority: Priority) -> bool:
        """A slot is free for this class and no request of it or a higher class waits."""
        return self.has_slot(priority) and not self.queues.ahead_of(priority)

    def _queue_problem(self, priority: Priority) -> tuple[str, str] | None:
        """Why a request with no slot free for it cannot queue for one; None if it can."""
        if self.config.queue_timeout(priority) <= 0:
            bound = self.config.inflight_bound(len(self.replicas))
            if self.num_admitted + self.num_granted >= bound:
                return "router_full", f"the router has {bound} requests in flight; retry shortly"
            return "router_full", (f"the router's free in-flight slots are kept for interactive "
                                   f"requests (--reserved-interactive "
                                   f"{self.config.reserved_interactive}); retry shortly")
        queued = len(self.queues)
        if queued >= self.config.queue_bound(len(self.replicas)):
            return "queue_full", (f"{queued} requests wait for an in-flight slot already "
                                  "(--max-queued); retry shortly")
        return None

    def _take_slot(self, priority: Priority) -> bool:
        if not self.has_slot(priority):
            return False
        self.num_granted += 1
        return True

    def grant(self) -> None:
        """Hand the free in-flight slots to the queued requests, in class order."""
        if self.queues:
            self.queues.grant(self._take_slot)

    async def queue_for_slot(self, priority: Priority, timeout: float, *, head: bool = False,
                             bounded_by: str | None = None) -> tuple[str, str] | None:
        """Wait in the class's queue until an in-flight slot is handed to this request (None:
        take it with `admitted()`, no await in between), the timeout passes, or the router
        begins stopping ((reason, message) of the 503). `head`: back to the head of its
        queue (a preempted request); `bounded_by`: what set `timeout`, for the message."""
        if self.stopping:  # its queue was emptied when the drain began (stop_all)
            return "stopping", "the router is shutting down; retry"
        if not head:
            problem = self._queue_problem(priority)
            if problem is not None:
                return problem
        label = priority.label
        waiter = self.queues.push(priority, head=head)
        self.grant()  # a slot may be free already (nobody of a higher class waits)
        if priority is Priority.INTERACTIVE and not waiter.done():
            self.preempt_bulk()
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = None
        try:
            try:
                async with _timeout(timeout):
                    result = await waiter
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() == GRANTED:
                    self.num_granted -= 1  # handed, never taken: to the next one
                    self.grant()
                else:
                    self.queues.discard(priority, waiter)
                raise
            if result is None and waiter.done() and not waiter.cancelled():
                result = waiter.result()  # handed as the timeout passed: taken all the same
            if result == GRANTED:
                self.num_granted -= 1
                return None
            if result == STOPPING:
                return "stopping", "the router is shutting down; retry"
            self.queues.discard(priority, waiter)
            self.metrics.queue_timeouts.labels(label).inc()
            return "queue_timeout", (
                f"no in-flight slot came free for this {label} request within {timeout:g} s "
                f"({bounded_by or f'--queue-timeout-{label}'}); retry")
        finally:
            self.metrics.queue_wait.labels(label).observe(loop.time() - started)

    def preempt_bulk(self) -> bool:
        """Take back the latest bulk request sent to a replica whose answer has not begun,
        and which has a replica it has not tried to go to later: its attempt is cancelled,
        its in-flight slot goes to the interactive request waiting, and it queues again at
        the head of the bulk queue (Forwarder._route). True if one was taken back."""
        for task, ex in reversed(list(self.bulk_attempts.items())):
            if task.done() or not ex.preemptible():
                continue
            if not any(r.routable and not ex.ctx.has_tried(r) for r in self.replicas):
                continue  # it could go nowhere else: taking it back would only fail it
            if task.cancel():
                ex.taken_back = True
                ex.record.preempted += 1
                self.metrics.preemptions.inc()
                return True
        return False

    def reading(self) -> _Slot:
        """Counts a request whose body is being read; the drain cut cancels it too."""
        return _Slot(self, "num_reading", "lowest_reading", cut_off=False)

    def admitted(self) -> _Slot:
        """Counts a request past admission until it is answered; the drain cut cancels it."""
        return _Slot(self, "num_admitted", "lowest_admitted", cut_off=True)

    def begin_drain(self, drain_s: float) -> None:
        """Refuse new requests now; cut off whatever is still in flight after `drain_s`.

        The router cuts itself, before aiohttp's shutdown does: aiohttp closes the transport
        right after cancelling a handler, which would leave no moment to end an SSE stream
        with its error event.
        """
        self.stopping = True
        self.drain_s = drain_s
        loop = asyncio.get_running_loop()
        self.drain_deadline = loop.time() + drain_s
        self._cut_timer = loop.call_at(self.drain_deadline, self._cut_off)
        self.replicas.changed.pulse()  # every wait for a replica ends now (find_replica)
        self.queues.stop_all()  # and every wait for a slot

    def _cut_off(self) -> None:
        self.cutting_off = True
        for task in list(self._active):
            task.cancel()

    def candidates(self, ctx: RequestContext) -> list[Replica]:
        """The replicas this request may go to now: routable, with room, not tried by it (in
        this generation: one restarted since is new to it)."""
        cap = self.config.max_inflight_per_replica
        return [r for r in self.replicas.routable()
                if r.in_flight < cap and not ctx.has_tried(r)]

    def select(self, ctx: RequestContext) -> Replica | None:
        return self.policy.select(self.candidates(ctx), ctx)

    async def wait_for_replica(self, ctx: RequestContext, wait_s: float,
                               record: RouteRecord) -> Replica | None:
        """select() found nothing (called with no await since): the first replica it finds
        within `wait_s` seconds (--replica-wait, bounded by the request's deadline; 0: none).

        The request waits in its in-flight slot, woken by the backends' pulse (a replica
        readmitted or enabled, a slot given back, the router stopping), not by polling: many
        waiters cost nothing while nothing changes. None when the wait runs out, or at once
        when the router is stopping: a router in front can send the request elsewhere, which
        a wait here would only delay.
        """
        if wait_s <= 0:
            return None
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcome = "cancelled"  # unless it ends otherwise: the client left, or the drain cut
        self.num_waiting += 1
        try:
            replica = None
            while replica is None:
                left = started + wait_s - loop.time()
                if self.stopping or left <= 0:
                    outcome = "stopping" if self.stopping else "timed_out"
                    return None
                # Taken right after select() found nothing (no await in between): no pulse
                # can fall between the two.
                changed = self.replicas.changed.next()
                with contextlib.suppress(asyncio.TimeoutError):
                    async with _timeout(left):
                        await changed.wait()
                replica = self.select(ctx)
            outcome = "found"
            return replica
        finally:
            self.num_waiting -= 1
            waited = loop.time() - started
            record.waited_s = round(record.waited_s + waited, 6)
            self.metrics.count_wait(outcome, waited)

    # --- the backends (admin API and the launcher) --------------------------------------
    async def add_replica(
        self, url: str, replica_id: str | None, disabled: bool, *, announce: bool = True
    ) -> Replica:
        replica = Replica(
            validate_id(replica_id) if replica_id is not None else self.replicas.next_id(),
            validate_url(url), disabled=disabled,
        )
        self.replicas.add(replica)
        self.grant()  # the in-flight bound may have grown
        if announce:
            self.on_change(ReplicaAdded(replica.id, replica.url, disabled))
        if self.probe_session is not None:
            await probe(self.probe_session, replica, self.config.health)
        return replica

    def set_disabled(self, replica: Replica, disabled: bool, *, announce: bool = True) -> None:
        """Enabling a disabled replica makes it routable at once.

        Whoever enables one (the launcher's supervisor, after its health, KV and MPS-attach
        gates) has proven more than our probes can; waiting for --health-successes probes
        would leave a ready replica idle for intervals. A replica the router itself ejected,
        and nobody disabled, still needs its probes.
        """
        was_disabled = replica.disabled
        replica.disabled = disabled
        if was_disabled and not disabled:
            mark_healthy(replica)
        if announce:
            self.on_change(ReplicaUpdated(replica.id, disabled))
        log.info("replica %s %s", replica.id,
                 "disabled" if disabled else f"enabled (health {replica.health.value})")

    def remove_replica(self, replica_id: str, *, announce: bool = True) -> Replica:
        replica = self.replicas.remove(replica_id)
        self.metrics.forget(replica_id)
        if announce:
            self.on_change(ReplicaRemoved(replica_id))
        return replica

    async def apply_change(self, change: SiblingChange) -> None:
        """Apply a change a sibling process made, without announcing it again."""
        try:
            if isinstance(change, ReplicaAdded):
                await self.add_replica(change.url, change.id, change.disabled, announce=False)
            elif isinstance(change, ReplicaUpdated) and (replica := self.replicas.get(change.id)):
                self.set_disabled(replica, change.disabled, announce=False)
            elif isinstance(change, ReplicaRemoved) and self.replicas.get(change.id):
                self.remove_replica(change.id, announce=False)
        except ReplicaError as exc:
            log.warning("could not apply %s from a sibling: %s", change, exc)

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        # The pool is never the limit: admission bounds the total, and each replica gets as
        # many connections as it may have requests in flight (aiohttp's default is 100 total).
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.config.max_inflight_per_replica,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # relay bytes exactly as the replica sent them
            # A replica's cookies are its client's: a jar would send them with every other
            # client's requests (and filtering it costs time on each request).
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=CLIENT_AUTO_HEADERS,  # only what the client sent goes upstream
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_s, connect=self.config.connect_timeout_s,
            ),
        )
        # Probes get a session of their own: a replica busy at its in-flight cap must still
        # be checkable, or being busy would look like being dead.
        self.probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                   cookie_jar=aiohttp.DummyCookieJar())
        self.health = HealthChecker(
            self.probe_session, lambda: self.replicas, self.config.health,
            rng=random.Random(self.config.seed),
        )
        health = self.config.health

        async def check_one(replica: Replica, seconds: float) -> tuple[bool, str]:
            return await check(self.probe_session, replica, health.path, seconds)

        self.hangs = HangWatch(check_one, health.timeout_s, record_hang)
        await self.health.check_all()  # route as soon as the first probes pass
        self.health.start()
        if self.metrics.multiprocess_dir is not None:
            self._metrics_writer = asyncio.create_task(self._write_metrics(),
                                                       name="metrics-writer")

    async def _write_metrics(self) -> None:
        """With several workers: keep this one's replica gauges fresh for its siblings'
        scrapes (a scrape this worker answers writes them first anyway)."""
        while True:
            self.metrics.write_shared()
            await asyncio.sleep(_SHARED_METRICS_S)

    async def stop(self) -> None:
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        if self._metrics_writer is not None:
            self._metrics_writer.cancel()
            await asyncio.gather(self._metrics_writer, return_exceptions=True)
        if self.health is not None:
            await self.health.stop()
        if self.hangs is not None:
            await self.hangs.stop()
        for session in (self.session, self.probe_session):
            if session is not None:
                await session.close()


# --- the application -----------------------------------------------------------------


def build_app(router: Router) -> web.Application:
    config = router.config
    forwarder = Forwarder(router)

    @web.middleware
    async def guard(request: web.Request, handler):
        if not request.raw_path.startswith("/"):
            # Absolute-form (`GET http://host/x`): this is no forward proxy, and the target
            # cannot be appended to a replica's URL.
            return json_error(400, "the request target must be a path (/...), not an absolute "
                                   f"URL: {request.raw_path[:200]!r}", "invalid_request_target")
        if request.path in OPS_PATHS and request.method in OPS_METHODS:
            return await handler(request)
        if config.api_key is not None and not _key_ok(request, config.api_key):
            return json_error(401, "missing or wrong API key: send Authorization: Bearer KEY",
                              "unauthorized")
        length = request.content_length
        if length is not None and length > config.max_body_bytes:
            # Refused before a byte of the body is read.
            return json_error(413, f"Content-Length {length} is over the router's limit of "
                                   f"{config.max_body_bytes} bytes (--max-body-bytes)",
                              "body_too_large")
        is_admin = request.path == ADMIN_PREFIX or request.path.startswith(ADMIN_PREFIX + "/")
        if is_admin and not config.admin_allow_remote and not is_loopback_address(request.remote):
            return json_error(403, "the admin API answers loopback clients only", "forbidden")
        return await handler(request)

    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[guard])
    app[ROUTER_KEY] = router
    app.router.add_get("/live", _live)
    app.router.add_get("/ready", _readiness)
    app.router.add_get("/health", _readiness)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get(ADMIN_PREFIX, _list_workers)
    app.router.add_post(ADMIN_PREFIX, _add_worker)
    app.router.add_put(ADMIN_PREFIX + "/{id}", _update_worker)
    app.router.add_delete(ADMIN_PREFIX + "/{id}", _remove_worker)
    app.router.add_get(SPEECH_STREAM_PATH, SpeechStreamProxy(router).handle)
    app.router.add_route("*", "/{tail:.*}", forwarder.handle)
    return app


def _key_ok(request: web.Request, key: str) -> bool:
    """`Authorization: Bearer KEY` (the scheme is case-insensitive, RFC 7235) or `X-API-Key`."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        given = credentials.strip(" ")
    else:
        given = request.headers.get("X-API-Key", "")
    return hmac.compare_digest(given.encode(), key.encode())


async def _live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER_KEY].metrics.exposition(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def _ready(router: Router) -> tuple[bool, int]:
    """(what /health answers, the routable replicas): ready while one is routable and the
    router is not stopping."""
    routable = len(router.replicas.routable())
    return routable > 0 and not router.stopping, routable


async def _readiness(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    ready, routable = _ready(router)
    body = {"status": "ready" if ready else "not_ready", "routable_replicas": routable,
            "total_replicas": len(router.replicas)}
    return web.json_response(body, status=200 if ready else 503)


async def _list_workers(request: web.Request) -> web.Response:
    """The backends and this process's view of it: what a router in front of this one,
    or a service-discovery system, reads (`ready` is what /health answers; the bounds are
    this process's share with --workers K)."""
    router = request.app[ROUTER_KEY]
    ready, routable = _ready(router)
    return web.json_response({
        "policy": router.policy.name,
        "in_flight": router.num_admitted,
        "waiting": router.num_waiting,
        "queued": {p.label: router.queues.depth(p) for p in Priority},
        "ready": ready,
        "stopping": router.stopping,
        "routable_replicas": routable,
        "max_inflight": router.config.inflight_bound(len(router.replicas)),
        "max_inflight_per_replica": router.config.max_inflight_per_replica,
        "workers": [r.describe() for r in router.replicas],
    })


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        raise ReplicaError("body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ReplicaError("body must be a JSON object")
    return body


async def _add_worker(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    try:
        body = await _json_object(request)
        unknown = sorted(set(body) - {"url", "id", "disabled"})
        if unknown:
            accepted = "url, id, disabled"
            raise ReplicaError(f"unknown field(s): {', '.join(unknown)}; accepted: {accepted}")
        if not isinstance(body.get("url"), str):
            raise ReplicaError("url is required and must be a string")
        if "id" in body and not isinstance(body["id"], str):
            raise ReplicaError("id must be a string")
        disabled = body.get("disabled", False)
        if not isinstance(disabled, bool):
            raise ReplicaError("disabled must be true or false")
        replica = await router.add_replica(body["url"], body.get("id"), disabled)
    except DuplicateReplica as exc:
        return json_error(409, str(exc), "conflict")
    except ReplicaError as exc:
        return json_error(400, str(exc), "invalid_request")
    return web.json_response(replica.describe(), status=201)


async def _update_worker(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    replica = router.replicas.get(request.match_info["id"])
    if replica is None:
        return json_error(404, f"no replica with id {request.match_info['id']!r}", "not_found")
    try:
        body = await _json_object(request)
        if set(body) != {"disabled"} or not isinstance(body["disabled"], bool):
            raise ReplicaError('send exactly {"disabled": true|false}')
    except ReplicaError as exc:
        return json_error(400, str(exc), "invalid_request")
    router.set_disabled(replica, body["disabled"])
    return web.json_response(replica.describe())


async def _remove_worker(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    try:
        replica = router.remove_replica(request.match_info["id"])
    except KeyError:
        return json_error(404, f"no replica with id {request.match_info['id']!r}", "not_found")
    log.info("replica %s removed (%d in flight finish normally)", replica.id, replica.in_flight)
    return web.json_response(replica.describe())


# --- running one process -------------------------------------------------------------


def make_runner(router: Router, shutdown_timeout: float) -> web.AppRunner:
    """The aiohttp runner with the router's connection-level bounds.

    Header reads rely on aiohttp's keep-alive timer: it is armed when a connection opens and
    again after each response, and closes the connection if no complete request head has
    arrived when it fires (aiohttp >= 3.10; its default is 3630 s). So a client that never
    finishes its headers is closed after --header-timeout, as is an idle keep-alive
    connection. Bodies have no such timer in aiohttp: the forwarder bounds them.
    """
    return web.AppRunner(
        build_app(router), handler_cancellation=True, access_log=None,
        shutdown_timeout=shutdown_timeout, keepalive_timeout=router.config.header_timeout_s,
    )


async def serve_router(
    config: RouterConfig,
    sock: socket.socket,
    drain_s: float = 30.0,
    attach: Callable[[Router], None] | None = None,
    metrics_dir: str | None = None,
) -> None:
    """Serve on `sock` until SIGTERM/SIGINT, then drain in-flight requests (bounded).

    `attach` connects the router to its siblings when several processes share the port, and
    `metrics_dir` is where they share their metrics.
    """
    router = Router(config, metrics_dir)
    # In this process (each worker its own): the exporter's thread must not cross a fork.
    router.tracer = start_tracing(config.otlp_traces_endpoint, ROUTER_SERVICE)
    if attach is not None:
        attach(router)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    runner = make_runner(router, shutdown_timeout=drain_s + _CUT_GRACE_S)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    routable = len(router.replicas.routable())
    log.info("router listening on http://%s:%d (policy %s, %d/%d replicas routable)",
             host, port, router.policy.name, routable, len(router.replicas))
    if not router.config.admin_allow_remote and not is_loopback_address(str(host)):
        log.info("the admin routes (%s) answer loopback clients only (--admin-allow-remote "
                 "opens them to others)", ADMIN_PREFIX)
    try:
        await stop.wait()
        log.info("stopping: draining %d request(s)", router.num_admitted)
        router.begin_drain(drain_s)
    finally:
        # Closes the listener and waits for the requests in flight; the router cuts off what
        # is left at drain_s (begin_drain), aiohttp whatever is left after that.
        await runner.cleanup()
        await router.stop()
        if router.tracer is not None:
            router.tracer.shutdown()
    # Cut off: cancelled past the deadline, or still admitted now (a cancellation not yet run).
    cut_off = router.num_cut_off + router.num_admitted
    if cut_off:
        log.warning("drain timeout (%gs) passed: cut off %d request(s) still in flight",
                    drain_s, cut_off)
    else:
        log.info("drained")
