"""A request's spans at the router (--otlp-traces-endpoint; omni_dp/tracing.py): one for the
request, the child of the client's traceparent when it sent a valid one, and one per attempt,
the request's child, whose traceparent goes to the replica in place of the client's (so the
replica's span is the attempt's child). Retries, resumes, migrations and a preemption are
events on the request's span; its attributes are the route log's (exchange.RouteRecord).

Made only when tracing is on: the proxy checks `router.tracer is None` and does nothing else.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from omni_dp.router.exchange import UpstreamFailed
from omni_dp.tracing import REPLICA_ATTR, TRACEPARENT, Tracer

if TYPE_CHECKING:
    from collections.abc import Iterator

    from aiohttp import web

    from omni_dp.router.exchange import Exchange, RouteRecord
    from omni_dp.router.replicas import Replica


class RequestTrace:
    """The router's spans of one request."""

    def __init__(self, tracer: Tracer, request: web.Request, record: RouteRecord) -> None:
        self.tracer = tracer
        self.span = tracer.start("router.request", request.headers.get(TRACEPARENT), {
            "http.request.method": request.method, "url.path": request.path,
            "omni_dp.route": request.path, "omni_dp.request_id": record.request_id,
        }, kind="server")

    def event(self, name: str, **attributes: Any) -> None:
        """A retry, resume, migration or preemption: when, and why."""
        self.span.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    @contextmanager
    def attempt(self, ex: Exchange, replica: Replica) -> Iterator[Any]:
        """One replica's attempt: its span, and its traceparent in the upstream headers."""
        record = ex.record
        span = self.tracer.start("router.attempt", self.span, {
            REPLICA_ATTR: replica.id, "server.address": replica.url,
            "omni_dp.attempt": record.attempts,
            "omni_dp.continues_from": ex.resume.offset if ex.response is not None else None,
        }, kind="client")
        ex.headers[TRACEPARENT] = self.tracer.traceparent(span)
        try:
            yield span
        except UpstreamFailed as exc:
            self.tracer.fail(span, exc.kind)
            raise
        except BaseException as exc:  # cancelled: the client left, a drain cut, a preemption
            self.tracer.fail(span, "taken_back" if ex.taken_back else type(exc).__name__)
            raise
        finally:
            span.end()

    def end(self, record: RouteRecord) -> None:
        """What the route log says, on the request's span; then it ends."""
        attributes = {
            REPLICA_ATTR: record.replica, "http.response.status_code": record.status or None,
            "omni_dp.outcome": record.outcome, "omni_dp.priority": record.priority,
            "omni_dp.attempts": record.attempts, "omni_dp.retries": len(record.retries),
            "omni_dp.resumes": len(record.resumes),
            "omni_dp.migrations": len(record.migrations), "omni_dp.preempted": record.preempted,
            "omni_dp.queued_s": record.queued_s, "omni_dp.ttfb_s": record.ttfb_s,
            "omni_dp.bytes": record.bytes, "omni_dp.cut": record.cut,
        }
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if record.outcome != "ok":
            self.tracer.fail(self.span, record.outcome)
        self.span.end()
