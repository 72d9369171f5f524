"""OpenTelemetry traces (omni_dp/tracing.py, router/tracing.py; docs/contracts.md "Traces").

The W3C traceparent's parsing and formatting, the wire messages that carry it to stage
processes, the router's spans and the header it sends upstream (in this process, against a
stand-in replica), tracing off (nothing imported, no exporter thread, no header added), and one
live trace through a router process, a replica process and the replica's voice stage process,
all exporting with the real OTLP/HTTP exporter to a receiver in this test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from omni_dp.contract import GOING_AWAY_HEADER, REPLICA_ENV, RUN_ID_ENV
from omni_dp.engine import messages, wire
from omni_dp.engine.preprocess import SpeechAsk
from omni_dp.engine.voice.messages import Speak
from omni_dp.tracing import (
    ROUTER_SERVICE,
    TRACEPARENT,
    endpoint_problem,
    format_traceparent,
    parse_traceparent,
    start_tracing,
)

from support.http_client import client, fetch, request
from support.otlp_receiver import OtlpReceiver
from support.recognizer import require_voice
from support.router import Backend, backends, echo, make_config, run, serve
from support.router_process import RouterProcess

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms: spans reach the receiver at once


# --- the traceparent ----------------------------------------------------------------------------
def test_a_valid_traceparent_is_read_and_written_back_alike():
    ids = parse_traceparent(CLIENT_TRACEPARENT)
    assert ids is not None
    assert (f"{ids.trace_id:032x}", f"{ids.span_id:016x}", ids.sampled) == (
        CLIENT_TRACE, CLIENT_SPAN, True)
    assert format_traceparent(ids.trace_id, ids.span_id, ids.sampled) == CLIENT_TRACEPARENT
    assert parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00").sampled is False
    # a later version may append fields; its first four are read
    assert parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra") is not None


@pytest.mark.parametrize("value", [
    None, "", "garbage", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}",  # too short
    f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",  # version ff is invalid
    f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{CLIENT_TRACE}-{'0' * 16}-01",  # all-zero ids
    f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01",  # upper-case hex
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra",  # version 00 has exactly four fields
])
def test_an_invalid_traceparent_is_ignored_not_refused(value):
    assert parse_traceparent(value) is None


def test_the_endpoint_must_be_an_http_url():
    assert endpoint_problem(None) is None
    assert endpoint_problem("http://127.0.0.1:4318/v1/traces") is None
    for bad in ("127.0.0.1:4318", "ftp://host/v1/traces", "http://"):
        assert "--otlp-traces-endpoint" in endpoint_problem(bad)


def test_a_bad_endpoint_is_exit_2_naming_the_flag():
    for command in (["router", "--replica", "http://127.0.0.1:9"], ["serve", "--dry-run"]):
        done = subprocess.run([sys.executable, "-m", "omni_dp", *command,
                               "--otlp-traces-endpoint", "localhost:4318"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "--otlp-traces-endpoint must be an http:// or https:// URL" in done.stderr
        assert "Traceback" not in done.stderr


def test_stage_messages_carry_the_traceparent_across_the_wire():
    ask = SpeechAsk("Hello.", "alloy", 1.0, None, None)
    for message in (messages.Prepare("p1", ask, CLIENT_TRACEPARENT),
                    Speak("s1", [1, 2, 3], 1.0, 0, CLIENT_TRACEPARENT)):
        assert wire.decode(wire.encode(message)).traceparent == CLIENT_TRACEPARENT
        untraced = dataclasses.replace(message, traceparent=None)
        assert wire.decode(wire.encode(untraced)).traceparent is None


# --- tracing off ------------------------------------------------------------------------------
def test_tracing_off_imports_nothing_of_opentelemetry():
    code = ("import sys\n"
            "import omni_dp.router.app, omni_dp.router.workers, omni_dp.engine.server\n"
            "import omni_dp.engine.stage_process, omni_dp.engine.voice.stages\n"
            "from omni_dp.tracing import start_tracing\n"
            "assert start_tracing(None, 'omni-dp-router') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_tracing_off_adds_no_header_and_starts_no_exporter():
    async def main():
        async with backends("a") as (a,), serve(make_config([a.url])) as served, \
                client() as session:
            assert served.router.tracer is None
            assert (await fetch(session, "GET", served.url + "/x"))[0] == 200
            header = {TRACEPARENT: CLIENT_TRACEPARENT}
            assert (await fetch(session, "GET", served.url + "/y", headers=header))[0] == 200
        assert TRACEPARENT not in a.seen[0].headers
        assert a.seen[1].headers[TRACEPARENT] == CLIENT_TRACEPARENT  # end to end, untouched

    run(main())
    assert not [t.name for t in threading.enumerate() if "OtelBatchSpanProcessor" in t.name]


# --- the router's spans ----------------------------------------------------------------------
def test_router_spans_keep_the_client_trace_and_parent_each_attempt(monkeypatch):
    """A request whose first replica goes away before answering: the request's span is the
    client's span's child, each attempt the request's, the retry an event; the replica that
    answered got its own attempt's traceparent."""
    for name, value in FAST_EXPORT.items():
        monkeypatch.setenv(name, value)
    first = []

    async def away_once(backend: Backend, request: web.Request, seen) -> web.StreamResponse:
        if not first:
            first.append(backend.name)
            return web.json_response({}, status=503, headers={GOING_AWAY_HEADER: "draining"})
        return await echo(backend, request, seen)

    with OtlpReceiver() as receiver:
        async def main():
            async with backends(Backend("a", away_once), Backend("b", away_once)) as (a, b), \
                    serve(make_config([f"a={a.url}", f"b={b.url}"])) as served, \
                    client() as session:
                served.router.tracer = start_tracing(receiver.endpoint, ROUTER_SERVICE)
                status, _, _ = await fetch(session, "POST", served.url + "/v1/audio/speech",
                                           data=b"{}", headers={TRACEPARENT: CLIENT_TRACEPARENT})
                assert status == 200
                await asyncio.to_thread(served.router.tracer.shutdown)  # flushes
                return [*a.seen, *b.seen]

        seen = run(main())
        spans = receiver.received()
    by_name = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (req,) = by_name["router.request"]
    assert (req.trace_id, req.parent_id, req.service) == (CLIENT_TRACE, CLIENT_SPAN,
                                                          ROUTER_SERVICE)
    assert req.attributes["omni_dp.attempts"] == 2
    assert req.attributes["omni_dp.retries"] == 1
    assert req.attributes["omni_dp.route"] == "/v1/audio/speech"
    assert [name for name, _ in req.events] == ["retry"]
    attempts = sorted(by_name["router.attempt"], key=lambda s: s.attributes["omni_dp.attempt"])
    other = ({"a", "b"} - set(first)).pop()
    assert [s.attributes["omni_dp.replica"] for s in attempts] == [first[0], other]
    assert all(s.trace_id == CLIENT_TRACE and s.parent_id == req.span_id for s in attempts)
    assert attempts[0].attributes["omni_dp.error"] == "going_away"
    # each replica got the traceparent of its own attempt, not the client's
    assert [s.headers[TRACEPARENT] for s in seen] == [
        f"00-{CLIENT_TRACE}-{s.span_id}-01" for s in attempts]


# --- one trace across three processes ---------------------------------------------------------
@pytest.mark.slow
def test_one_trace_crosses_router_replica_and_voice_stage_process(start_replica, tmp_path,
                                                                   monkeypatch):
    """Router process → replica process → the replica's stage processes (preprocess, voice):
    one trace, the client's, each span the child of the one before it, one voice span per
    sentence."""
    require_voice()
    for name, value in {**FAST_EXPORT, RUN_ID_ENV: "trace-run", REPLICA_ENV: "r0"}.items():
        monkeypatch.setenv(name, value)
    with OtlpReceiver() as receiver:
        replica = start_replica("--model", "joe", "--preprocess.process", "pre",
                                "--voice.process", "voice",
                                "--otlp-traces-endpoint", receiver.endpoint)
        router = RouterProcess(tmp_path / "router.log", "--replica", f"r0={replica.url}",
                               "--otlp-traces-endpoint", receiver.endpoint)

        async def main():
            await router.start()
            try:
                await router.wait_listening()
                answer = await asyncio.to_thread(
                    request, "POST", router.url + "/v1/audio/speech",
                    {"input": "It is a nice day. I am going home.", "response_format": "pcm"},
                    headers={TRACEPARENT: CLIENT_TRACEPARENT}, timeout=120)
                assert await router.stop() == 0  # SIGTERM: it flushes its spans as it stops
                return answer
            finally:
                router.kill()

        status, _, body = run(main())
        assert status == 200 and body, body[:200]
        spans = receiver.wait_for(
            lambda got: {"router.request", "router.attempt", "replica.speech", "stage.preprocess"}
            <= {s.name for s in got} and sum(s.name == "stage.voice" for s in got) >= 2,
            what="the router's, the replica's, the preprocess's and two sentences' spans")
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    one = {s.name: s for s in spans}
    req, attempt, speech = one["router.request"], one["router.attempt"], one["replica.speech"]
    voices = [s for s in spans if s.name == "stage.voice"]
    assert req.parent_id == CLIENT_SPAN
    assert attempt.parent_id == req.span_id
    assert speech.parent_id == attempt.span_id
    assert one["stage.preprocess"].parent_id == speech.span_id
    assert one["stage.preprocess"].attributes["omni_dp.stage_process"] == "pre"
    assert all(v.parent_id == speech.span_id for v in voices), json.dumps(
        [dataclasses.asdict(v) for v in voices])
    assert (req.service, speech.service, voices[0].service) == (
        "omni-dp-router", "omni-dp-replica", "omni-dp-stage")
    assert speech.attributes["omni_dp.format"] == "pcm"
    assert speech.attributes["omni_dp.priority"] == "default"
    for voice in voices:
        assert voice.attributes["omni_dp.stage"] == "voice"
        assert voice.attributes["omni_dp.stage_process"] == "voice"
        assert voice.attributes["omni_dp.run"] == "trace-run"
        assert voice.attributes["omni_dp.replica"] == "r0"
