"""`omni-dp router` as a process: bad options, one worker, and K workers on one port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from support.http_client import fetch
from support.ports import LOOPBACK
from support.router import Backend, backends, run
from support.router_process import RouterProcess
from support.wait import until

_ROUTE = re.compile(r'omni_dp\.router\.access\[(\d+)\]: \{"event":"route"')


def omni_dp_router(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_dp", "router", *args],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(("args", "message"), [
    (["--replica", "ftp://127.0.0.1:1"], "must look like http://HOST:PORT"),
    (["--replica", "http://127.0.0.1:1/v1"], "must not have a path"),
    (["--replica", "a=http://127.0.0.1:1", "--replica", "a=http://127.0.0.1:2"], "repeated: a"),
    (["--policy", "fastest"], "Invalid value for '--policy'"),
    (["--workers", "2", "--port", "0"], "needs a fixed --port"),
    (["--health-jitter", "1.5"], "--health-jitter"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--max-body-bytes", "lots"], "is not a size"),
    (["--replica", "http://[::1"], "must look like http://HOST:PORT"),
    (["--body-timeout", "0"], "--body-timeout and --header-timeout must be positive"),
    (["--header-timeout", "-1"], "--body-timeout and --header-timeout must be positive"),
    (["--max-body-readers", "0"], "--max-body-readers must be at least 1"),
    (["--retries", "-1"], "--retries must be 0 or more"),
    (["--retries", "one"], "Invalid value for '--retries'"),
    (["--first-byte-timeout", "nan"], "--first-byte-timeout must be a finite number"),
    (["--stall-timeout", "-2"], "--first-byte-timeout and --stall-timeout must be 0"),
    (["--migration-limit", "-1"], "--migration-limit must be 0 or more"),
    (["--migration-limit", "1.5"], "Invalid value for '--migration-limit'"),
    (["--migration-max-seq-len", "0"], "--migration-max-seq-len must be at least 1"),
    (["--migration-path", "/v1/audio/speech"], "--migration-path must be one of"),
])
def test_bad_options_exit_2_with_a_message(args, message):
    result = omni_dp_router(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_every_problem_is_reported_at_once():
    result = omni_dp_router("--replica", "ftp://x", "--workers", "0", "--health-failures", "0")
    assert result.returncode == 2
    assert len([line for line in result.stderr.splitlines()
                if line.startswith("omni-dp router: ")]) == 3


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_in_use_exits_2(workers):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = omni_dp_router("--port", str(port), "--workers", workers)
    assert result.returncode == 2, result.stderr
    assert "cannot listen on" in result.stderr and "pick another --port" in result.stderr
    assert "Traceback" not in result.stderr


def test_router_help_documents_every_flag():
    from omni_dp.cli import router

    result = subprocess.run([sys.executable, "-m", "omni_dp", "router", "--help"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for param in router.params:
        for flag in param.opts:
            assert flag in result.stdout, flag
        assert param.help, f"{param.opts[0]} has no help text"


# --- running routers -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def router_before(backend: Backend, log: Path, drain_timeout: str):
    """A listening router with the one backend as its replica; killed by pid on the way out
    (and the backend's held requests released first, so nothing waits past the test)."""
    router = RouterProcess(log, "--replica", f"{backend.name}={backend.url}",
                           "--drain-timeout", drain_timeout)
    try:
        await router.start()
        await router.wait_listening()
        yield router
    finally:
        backend.release.set()
        router.kill()


async def held_speech_request(session: aiohttp.ClientSession, router: RouterProcess,
                              backend: Backend) -> asyncio.Task:
    """A speech request through the router that the backend holds (it has seen it)."""
    held = asyncio.create_task(fetch(session, "POST", router.url + "/v1/audio/speech",
                                     data=b"{}"))
    await until(lambda: len(backend.seen) == 1)
    return held


def fresh_session() -> aiohttp.ClientSession:
    """Every request on a new TCP connection: the kernel spreads them over the workers."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=10))


def test_one_worker_serves_and_stops_cleanly_on_sigterm(tmp_path):
    async def main():
        async with backends("a", "b") as (a, b):
            router = RouterProcess(tmp_path / "router.log", "--replica", f"a={a.url}",
                                   "--replica", f"b={b.url}", "--policy", "round_robin")
            try:
                await router.start()
                await router.wait_listening()
                async with fresh_session() as session:
                    ready, _, _ = await fetch(session, "GET", router.url + "/ready")
                    picks = [(await fetch(session, "POST", router.url + "/v1/audio/speech",
                                          data=b'{"input": "x"}'))[1]["X-Omni-DP-Replica"]
                             for _ in range(4)]
                code = await router.stop()
                return ready, picks, code, router.log_text(), len(a.seen) + len(b.seen)
            finally:
                router.kill()

    ready, picks, code, log, seen = run(main())
    assert ready == 200
    assert picks == ["a", "b", "a", "b"]
    assert seen == 4
    assert code == 0, log
    assert "Traceback" not in log
    routes = [json.loads(line.split(": ", 1)[1]) for line in log.splitlines()
              if '"event":"route"' in line]
    assert [r["replica"] for r in routes] == picks
    assert all(r["status"] == 200 and r["attempts"] == 1 for r in routes)


def test_two_workers_share_one_port_and_the_admin_state(tmp_path):
    async def consecutive(session, url: str, check, needed: int = 20, timeout: float = 3.0):
        """`needed` fresh-connection GETs of /workers in a row satisfy `check` (so both
        workers do, almost surely)."""
        deadline, streak = time.monotonic() + timeout, 0
        while streak < needed:
            assert time.monotonic() < deadline, f"/workers never settled ({streak} in a row)"
            _, _, body = await fetch(session, "GET", url + "/workers")
            streak = streak + 1 if check(json.loads(body)) else 0
            if streak == 0:
                await asyncio.sleep(0.01)

    def ids(listing) -> set[str]:
        return {w["id"] for w in listing["workers"]}

    async def main():
        async with backends("a", "b", "c") as (a, b, c):
            router = RouterProcess(tmp_path / "router.log", "--workers", "2",
                                   "--replica", f"a={a.url}", "--replica", f"b={b.url}")
            try:
                await router.start()
                await router.wait_listening(workers=2)
                parent = psutil.Process(router.proc.pid)
                children = parent.children(recursive=True)
                async with fresh_session() as session:
                    async def one(i):
                        return await fetch(session, "POST", router.url + "/generate",
                                           data=json.dumps({"i": i}).encode())

                    results = []
                    for start in range(0, 200, 10):
                        results += await asyncio.gather(*(one(i) for i in range(start, start + 10)))
                    await until(lambda: len(_ROUTE.findall(router.log_text())) >= 200, 3,
                                "200 route lines")
                    served_by = set(_ROUTE.findall(router.log_text()))

                    status, _, body = await fetch(session, "POST", router.url + "/workers",
                                                  json={"url": c.url, "id": "c"})
                    assert status == 201, body
                    await consecutive(session, router.url, lambda w: "c" in ids(w))
                    status, _, _ = await fetch(session, "PUT", router.url + "/workers/a",
                                               json={"disabled": True})
                    assert status == 200
                    await consecutive(session, router.url, lambda w: next(
                        x for x in w["workers"] if x["id"] == "a")["disabled"] is True)
                    a_before = len(a.seen)
                    picks = [(await one(i))[1]["X-Omni-DP-Replica"] for i in range(30)]
                    status, _, _ = await fetch(session, "DELETE", router.url + "/workers/c")
                    assert status == 200
                    await consecutive(session, router.url, lambda w: ids(w) == {"a", "b"})
                    a_after = len(a.seen)
                code = await router.stop()
                _gone, alive = psutil.wait_procs(children, timeout=5)
                return (results, served_by, picks, a_after - a_before, code, children, alive,
                        router.log_text())
            finally:
                router.kill()

    results, served_by, picks, a_new, code, children, alive, log = run(main())
    assert [status for status, _, _ in results] == [200] * 200
    assert served_by == {"0", "1"}, f"only worker(s) {served_by} served 200 fresh connections"
    assert "c" in picks  # the replica added through one worker gets traffic from both
    assert "a" not in picks and a_new == 0  # disabled everywhere
    assert code == 0, log
    assert len(children) >= 2
    assert alive == [], f"children left running: {[p.pid for p in alive]}"
    assert "Traceback" not in log


def _promtool_problems(text: str) -> str | None:
    """promtool's complaints about an exposition (empty when clean); None without promtool."""
    tool = os.environ.get("OMNI_DP_PROMTOOL") or shutil.which("promtool")
    if tool is None:
        return None
    done = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    return (done.stdout + done.stderr).strip() if done.returncode else ""


def test_two_workers_expose_one_coherent_metrics_view(tmp_path):
    """With --workers 2 each request is counted by the worker that served it, yet every
    scrape, whichever worker answers it, reads the sums over both."""
    requests = 40

    async def main():
        async with backends("a", "b") as (a, b):
            router = RouterProcess(tmp_path / "router.log", "--workers", "2",
                                   "--replica", f"a={a.url}", "--replica", f"b={b.url}")
            try:
                await router.start()
                await router.wait_listening(workers=2)
                async with fresh_session() as session:
                    for _ in range(requests):
                        status, _, _ = await fetch(session, "POST", router.url + "/generate",
                                                   data=b"{}")
                        assert status == 200
                    await until(lambda: len(_ROUTE.findall(router.log_text())) >= requests, 3,
                                "the route lines")
                    served_by = set(_ROUTE.findall(router.log_text()))
                    scrapes = []
                    for _ in range(12):  # fresh connections: both workers answer some
                        status, headers, body = await fetch(session, "GET",
                                                            router.url + "/metrics")
                        assert status == 200 and headers["Content-Type"].startswith(
                            "text/plain")
                        scrapes.append(body.decode())
                code = await router.stop()
                return served_by, scrapes, code, router.log_text()
            finally:
                router.kill()

    served_by, scrapes, code, log = run(main())
    assert served_by == {"0", "1"}, f"only worker(s) {served_by} served fresh connections"
    for text in scrapes:
        families = {f.name: f for f in text_string_to_metric_families(text)}
        counted = families["omni_dp_router_requests"].samples
        assert sum(s.value for s in counted) == requests, text
        assert {s.labels["replica"] for s in counted} == {"a", "b"}
        durations = [s for s in families["omni_dp_router_request_duration_seconds"].samples
                     if s.name.endswith("_count")]
        assert [s.value for s in durations] == [requests]
        in_flight = families["omni_dp_router_in_flight"].samples
        assert {s.labels["replica"]: s.value for s in in_flight} == {"a": 0, "b": 0}
        healthy = families["omni_dp_router_replica_healthy"].samples
        assert {s.labels["replica"]: s.value for s in healthy} == {"a": 1, "b": 1}
    assert _promtool_problems(scrapes[0]) in ("", None)
    assert code == 0, log
    assert "Traceback" not in log


async def hold(backend, request, seen):
    await backend.release.wait()
    return web.Response(body=b"finished")


def test_sigterm_drains_the_request_in_flight_then_exits_0(tmp_path):
    async def main():
        backend = Backend("a", hold)
        async with backends(backend), \
                router_before(backend, tmp_path / "router.log", "10") as router:
            async with fresh_session() as session:
                held = await held_speech_request(session, router, backend)
                os.kill(router.proc.pid, signal.SIGTERM)
                await until(lambda: "draining 1 request" in router.log_text(), 5, "drain")
                still_running = router.proc.returncode is None
                backend.release.set()
                status, _, body = await held
            code = await asyncio.wait_for(router.proc.wait(), 10)
            return still_running, status, body, code, router.log_text()

    still_running, status, body, code, log = run(main())
    assert still_running
    assert (status, body) == (200, b"finished")
    assert code == 0, log
    assert "Traceback" not in log
    assert "INFO omni_dp.router: drained" in log
    assert "cut off" not in log


def test_drain_timeout_cuts_off_what_is_still_in_flight_and_says_so(tmp_path):
    async def main():
        backend = Backend("a", hold)  # released only at the end: the request never finishes
        async with backends(backend), \
                router_before(backend, tmp_path / "router.log", "0.5") as router:
            async with fresh_session() as session:
                held = await held_speech_request(session, router, backend)
                code = await router.stop()
                (outcome,) = await asyncio.gather(held, return_exceptions=True)
            return outcome, code, router.log_text()

    outcome, code, log = run(main())
    assert isinstance(outcome, aiohttp.ClientError), outcome  # cut off, not answered
    assert code == 0, log
    assert "draining 1 request" in log
    assert re.search(r"WARNING omni_dp\.router: drain timeout \(0\.5s\) passed: "
                     r"cut off 1 request\(s\) still in flight", log), log
    assert "drained" not in log
    assert "Traceback" not in log


def test_drain_timeout_ends_an_sse_stream_with_an_error_event(tmp_path):
    """The cut SSE stream gets the same `data: {"error": ...}` event as a replica dying
    mid-stream, then breaks: never a clean end."""

    async def sse(backend, request, seen):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await backend.release.wait()  # only at the end of the test: past any drain
        return resp

    async def main():
        backend = Backend("a", sse)
        async with backends(backend), \
                router_before(backend, tmp_path / "router.log", "0.5") as router:
            events, broken = [], None
            async with fresh_session() as session, \
                    session.post(router.url + "/v1/audio/speech", data=b"{}") as resp:
                assert resp.status == 200
                try:
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            events.append(json.loads(line[6:]))
                            if len(events) == 1:
                                os.kill(router.proc.pid, signal.SIGTERM)
                except aiohttp.ClientPayloadError as exc:
                    broken = exc
            code = await asyncio.wait_for(router.proc.wait(), 10)
            return events, broken, code, router.log_text()

    events, broken, code, log = run(main())
    assert events[0] == {"n": 1}
    assert len(events) == 2, events
    error = events[1]["error"]
    assert error["type"] == "drain_timeout" and error["code"] == 503
    assert "drain timeout (0.5s)" in error["message"]
    assert broken is not None, "the cut stream ended cleanly"
    assert code == 0, log
    assert "cut off 1 request(s)" in log
    route = next(json.loads(line.split(": ", 1)[1]) for line in log.splitlines()
                 if '"event":"route"' in line)
    assert route["outcome"] == "drain_cut_off" and route["client_disconnected"] is False
