"""OpenTelemetry traces across the router, the replicas and their stage processes (off by
default; --otlp-traces-endpoint URL turns them on, as vLLM's flag of that name does).

Off, nothing of OpenTelemetry is imported and a request costs one `is None` check. On, each
process makes one tracer (service.name omni-dp-router, omni-dp-replica or omni-dp-stage; the
run and replica ids from the launcher's environment as resource attributes), exports its spans
over OTLP/HTTP (protobuf) from the SDK's BatchSpanProcessor thread, and flushes on shutdown.

The context crosses processes as a W3C `traceparent` (version 00): an HTTP header from the
client to the router and from the router to a replica (each attempt its own span, so the
replica's span is the attempt's child), and a field of the wire messages a replica's front
sends its stage processes (engine/messages.py Prepare, engine/voice/messages.py Speak). Within
a replica the request's traceparent travels in a context variable (asyncio copies it into the
tasks a request starts), so the pipeline reads it where it builds a message.

The parsing and formatting of traceparent are pure and apart from the SDK (tested alone).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from omni_dp.contract import REPLICA_ENV, RUN_ID_ENV

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C Trace Context header (lower case, as the spec writes it)
ENDPOINT_FLAG = "--otlp-traces-endpoint"
ROUTER_SERVICE = "omni-dp-router"
REPLICA_SERVICE = "omni-dp-replica"
STAGE_SERVICE = "omni-dp-stage"
# Span attribute names (docs/contracts.md, "Traces").
RUN_ATTR = "omni_dp.run"
REPLICA_ATTR = "omni_dp.replica"
STAGE_ATTR = "omni_dp.stage"
PROCESS_ATTR = "omni_dp.stage_process"

# version 00: 2 hex, 32 hex trace id, 16 hex parent id, 2 hex flags (W3C Trace Context §3.2).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True)
class SpanContextIds:
    """What a traceparent names: the trace, the parent span, whether it was sampled."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: str | None) -> SpanContextIds | None:
    """The ids of a valid traceparent; None for a missing or invalid one, which W3C says to
    ignore (a new trace starts), never to refuse."""
    if not value:
        return None
    value = value.strip()
    match = _TRACEPARENT.fullmatch(value[:55]) if len(value) >= 55 else None
    if match is None:
        return None
    version, trace_id, span_id, flags = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and len(value) != 55:  # a later version may append fields, 00 not
        return None
    return SpanContextIds(int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1))


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def endpoint_problem(url: str | None) -> str | None:
    """What is wrong with an OTLP/HTTP traces endpoint (None when it is fine or not given)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (f"{ENDPOINT_FLAG} must be an http:// or https:// URL of an OTLP/HTTP traces "
                f"receiver (e.g. http://127.0.0.1:4318/v1/traces), got {url!r}")
    return None


# --- the request's context inside one process ---------------------------------------------
# The traceparent a replica's request span passes on (to the messages its pipeline sends stage
# processes); None when tracing is off or outside a request.
_current: ContextVar[str | None] = ContextVar("omni_dp_traceparent", default=None)


def current_traceparent() -> str | None:
    return _current.get()


def set_current(traceparent: str | None):
    """Make `traceparent` the current request's; returns the token to reset it with."""
    return _current.set(traceparent)


def reset_current(token) -> None:
    _current.reset(token)


# --- the SDK, only when tracing is on ------------------------------------------------------
class Tracer:
    """One process's tracer and exporter (the SDK, imported here only)."""

    def __init__(self, endpoint: str, service: str, attributes: dict[str, str]) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            set_span_in_context,
        )

        self._types = (NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context)
        self.kinds = SpanKind
        self.error = Status(StatusCode.ERROR)
        self.resource_attributes = {"service.name": service, **attributes}
        self.span_attributes = attributes  # run and replica on every span too: easy to filter
        self.provider = TracerProvider(resource=Resource.create(self.resource_attributes))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("omni_dp")

    def start(self, name: str, parent: str | Any | None = None,
              attributes: dict[str, Any] | None = None, kind: str = "internal") -> Any:
        """A started span: the child of `parent` (a traceparent, or one of our spans), else
        a new trace's root. The caller ends it."""
        if isinstance(parent, str) or parent is None:
            context = self._remote(parent)
        else:
            context = self._types[3](parent)
        return self.tracer.start_span(name, context=context,
                                      attributes={**self.span_attributes, **(attributes or {})},
                                      kind=getattr(self.kinds, kind.upper()))

    def _remote(self, traceparent: str | None):
        ids = parse_traceparent(traceparent)
        if ids is None:
            return None
        span_type, context_type, flags, in_context = self._types
        remote = context_type(ids.trace_id, ids.span_id, is_remote=True,
                              trace_flags=flags(flags.SAMPLED if ids.sampled else 0))
        return in_context(span_type(remote))

    @staticmethod
    def traceparent(span: Any) -> str:
        """The traceparent that makes a process's span the parent of what it calls."""
        ctx = span.get_span_context()
        return format_traceparent(ctx.trace_id, ctx.span_id, bool(ctx.trace_flags & 1))

    def fail(self, span: Any, why: str) -> None:
        span.set_status(self.error)
        span.set_attribute("omni_dp.error", why)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the SDK's export timeout) and stop its thread."""
        try:
            self.provider.shutdown()
        except Exception as exc:  # a receiver gone at shutdown must not fail the stop
            log.warning("tracing: the last spans could not be exported: %s", exc)


def run_attributes() -> dict[str, str]:
    """The run and replica ids the launcher put in this process's environment, if any."""
    attributes = {}
    if os.environ.get(RUN_ID_ENV):
        attributes[RUN_ATTR] = os.environ[RUN_ID_ENV]
    if os.environ.get(REPLICA_ENV):
        attributes[REPLICA_ATTR] = os.environ[REPLICA_ENV]
    return attributes


def start_tracing(endpoint: str | None, service: str,
                  attributes: dict[str, str] | None = None) -> Tracer | None:
    """This process's tracer, or None (nothing imported) when no endpoint was given."""
    if endpoint is None:
        return None
    tracer = Tracer(endpoint, service, {**run_attributes(), **(attributes or {})})
    log.info("tracing: exporting %s's spans to %s", service, endpoint)
    return tracer


# A stage process's tracer (engine/stage_process.py sets it once at start; its stages read it).
_process_tracer: Tracer | None = None


def install(tracer: Tracer | None) -> None:
    global _process_tracer
    _process_tracer = tracer


def process_tracer() -> Tracer | None:
    return _process_tracer


@contextmanager
def stage_work(stage: str, process: str, traceparent: str | None) -> Iterator[Any]:
    """A stage process's span around one piece of a request's work (a sentence, a
    preprocess), the child of the request's span at the replica; nothing when this process
    does not trace or the message carries no traceparent."""
    tracer = _process_tracer
    if tracer is None or traceparent is None:
        yield None
        return
    span = tracer.start(f"stage.{stage}", traceparent,
                        {STAGE_ATTR: stage, PROCESS_ATTR: process}, kind="consumer")
    try:
        yield span
    except BaseException as exc:
        tracer.fail(span, type(exc).__name__)
        raise
    finally:
        span.end()
