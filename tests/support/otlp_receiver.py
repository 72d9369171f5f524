"""An OTLP/HTTP traces receiver on loopback, in a thread of the test process: it stands in for
an OpenTelemetry collector. It decodes each POST /v1/traces (an ExportTraceServiceRequest,
protobuf, with the opentelemetry-proto package's classes) into `spans`, one ReceivedSpan each.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from support.ports import LOOPBACK


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_id: str  # 16 hex, "" for a root
    kind: int
    attributes: dict
    resource: dict
    events: tuple[tuple[str, dict], ...] = field(default=())


def _value(any_value) -> object:
    which = any_value.WhichOneof("value")
    return getattr(any_value, which) if which else None


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    str(resource.get("service.name")), span.name, span.trace_id.hex(),
                    span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                    _attributes(span.attributes), resource,
                    tuple((e.name, _attributes(e.attributes)) for e in span.events)))
    return spans


class OtlpReceiver:
    """`with OtlpReceiver() as receiver:` … `receiver.endpoint`, `receiver.wait_for(...)`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.endpoint = ""
        self._thread = threading.Thread(target=self._serve, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        assert self._ready.wait(10), "the OTLP receiver did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        self._loop.run_until_complete(site.start())
        self.endpoint = f"http://{LOOPBACK}:{self._runner.addresses[0][1]}/v1/traces"
        self._ready.set()
        self._loop.run_forever()

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf", request.content_type
        spans = decode(await request.read())
        with self._lock:
            self.spans.extend(spans)
            self.posts += 1
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done, timeout: float = 30.0, what: str = "spans") -> list[ReceivedSpan]:
        """The spans, once `done(spans)` holds (bounded: an AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.received()
            if done(spans):
                return spans
            time.sleep(0.05)
        spans = self.received()
        raise AssertionError(f"{what}: not received within {timeout} s; got "
                             f"{[(s.service, s.name) for s in spans]}")
