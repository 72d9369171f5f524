"""The router benchmark's parts that run things: two trivial aiohttp backends
(`python router_targets.py --backend PORT`), the targets in front of them (direct, `omni-dp
router`, sglang-router and smg from throwaway venvs, and a bare aiohttp relay as the floor:
`--relay PORT URL...`), the load generators (wrk, or an aiohttp client in
its own process: `--loadgen-child SPEC`), the streamed time-to-first-byte probe, and the CPU
that a target's process tree spends. Everything started is stopped by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from omni_dp.bench.stats import percentile

REPO = Path(__file__).resolve().parent.parent


HOST = "127.0.0.1"


EVENTS = 20


PACE_S = 0.005


# The mode travels in the body's `text`: sglang-router re-serialises bodies and drops unknown
# fields and custom headers, but keeps `text` and `stream`.
BODIES = {
    "json": b'{"text":"json","stream":false}',
    "sse": b'{"text":"sse","stream":true}',
    "paced": b'{"text":"paced","stream":true}',
}


def run_backend(port: int) -> None:
    from aiohttp import web

    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    answer = json.dumps({
        "text": "The quick brown fox jumps over the lazy dog near the river bank.",
        "meta_info": {"id": "0123456789abcdef0123456789abcdef", "prompt_tokens": 5,
                      "completion_tokens": 16, "finish_reason": {"type": "stop"}},
    }, separators=(",", ":")).encode()
    events = [
        b'data: {"text":"token %02d ","index":%d,"meta_info":{"completion_tokens":%d}}\n\n'
        % (i, i, i + 1) for i in range(EVENTS)
    ] + [b"data: [DONE]\n\n"]

    async def generate(request: web.Request) -> web.StreamResponse:
        mode = json.loads(await request.read()).get("text")
        if mode not in ("sse", "paced"):
            return web.Response(body=answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for i, event in enumerate(events):
            if mode == "paced" and i:
                await asyncio.sleep(PACE_S)
            await response.write(event)
        await response.write_eof()
        return response

    info = {"model_path": "bench-backend", "served_model_name": "bench-backend"}
    models = {"object": "list", "data": [{"id": "bench-backend", "object": "model",
                                          "created": 0, "owned_by": "bench"}]}
    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    # The gateways' discovery calls: sglang-router 0.3.2 reads /get_server_info and
    # /get_model_info; smg 1.13 detects the backend by /v1/models, /version or /server_info.
    for path in ("/get_server_info", "/get_model_info", "/server_info", "/model_info"):
        app.router.add_get(path, lambda r: web.json_response(info))
    app.router.add_get("/v1/models", lambda r: web.json_response(models))
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def run_relay(port: int, backends: list[str]) -> None:
    """The floor: the least an aiohttp + uvloop hop can do (round robin, one shared client
    session, a small answer of known length read whole and sent in one write, anything else
    relayed as it arrives), with none of the router's health, admission, retries or metrics.
    What omni-dp's router costs above this is its own; what this costs is aiohttp's."""
    from aiohttp import web

    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    hop = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}
    turn = 0

    async def relay(request: web.Request) -> web.StreamResponse:
        nonlocal turn
        turn += 1
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        url = backends[turn % len(backends)] + request.raw_path
        async with session.request(request.method, url, data=body, headers=headers) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in hop}
            if up.content_length is not None and up.content_length <= 65536:
                return web.Response(body=await up.read(), status=up.status, headers=out)
            response = web.StreamResponse(status=up.status, headers=out)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        auto_decompress=False,
                                        cookie_jar=aiohttp.DummyCookieJar())

    session: aiohttp.ClientSession
    app = web.Application()
    app.on_startup.append(start)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_route("*", "/{tail:.*}", relay)
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def run_loadgen_child(spec: dict) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def drive() -> dict:
        latencies: list[float] = []
        errors = 0
        deadline = time.perf_counter() + spec["duration"]
        connector = aiohttp.TCPConnector(limit=spec["concurrency"])
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client() -> None:
                nonlocal errors
                while time.perf_counter() < deadline:
                    start = time.perf_counter()
                    try:
                        async with session.post(spec["url"], data=spec["body"].encode(),
                                                headers=headers) as resp:
                            await resp.read()
                            ok = resp.status == 200
                    except aiohttp.ClientError:
                        ok = False
                    latencies.append(time.perf_counter() - start)
                    errors += not ok

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(spec["concurrency"])))
            wall = time.perf_counter() - started
        return {"requests": len(latencies), "errors": errors, "wall_s": wall,
                "p50_ms": ms(latencies, 50), "p99_ms": ms(latencies, 99)}

    print(json.dumps(asyncio.run(drive())))


@dataclass
class Target:
    name: str  # short key: direct, omni-w1, omni-w2, omni-w1-info, sglang, smg, relay
    url: str
    command: str  # how it was started, for the record
    procs: list[psutil.Process] = field(default_factory=list)  # the hop's CPU is theirs


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def sched_cpu_seconds(procs: list[psutil.Process]) -> float:
    """CPU time from /proc/PID/task/*/schedstat (ns), summed over live threads; psutil's
    user+system counts whole clock ticks (10 ms), too coarse for a few dozen requests."""
    total = 0.0
    for proc in procs:
        tasks = Path(f"/proc/{proc.pid}/task")
        if not tasks.is_dir():
            return cpu_seconds(procs)
        for task in tasks.iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _wrk_ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(number) * _WRK_UNITS[unit]


def run_wrk(url: str, concurrency: int, duration: float, body: bytes, tmp: Path) -> dict:
    script = tmp / f"body-{abs(hash(body))}.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{body.decode()}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{duration:g}s", "--latency", "--timeout", "5s",
           "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30).stdout
    total = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if total is None:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    dist = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock_err = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                         out)
    errors = (int(non_2xx.group(1)) if non_2xx else 0) + (
        sum(int(g) for g in sock_err.groups()) if sock_err else 0)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return {"requests": int(total.group(1)), "errors": errors,
            "requests_per_s": float(rps.group(1)),
            "p50_ms": _wrk_ms(dist["50"]), "p99_ms": _wrk_ms(dist["99"])}


def run_python_loadgen(url: str, concurrency: int, duration: float, body: bytes) -> dict:
    spec = {"url": url, "concurrency": concurrency, "duration": duration, "body": body.decode()}
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen-child", json.dumps(spec)],
        capture_output=True, text=True, timeout=duration + 60, check=True,
    ).stdout
    result = json.loads(out)
    result["requests_per_s"] = result["requests"] / result["wall_s"]
    return result


async def measure_ttfb(url: str, requests: int) -> tuple[list[float], list[float]]:
    """Paced SSE at concurrency 1 over one keep-alive connection: (ttfb list, total list)."""
    ttfbs, totals = [], []
    connector = aiohttp.TCPConnector(limit=1)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(requests + 3):  # 3 warm-up requests, not counted
            start = time.perf_counter()
            async with session.post(url, data=BODIES["paced"], headers=headers) as resp:
                first = await resp.content.readany()
                ttfb = time.perf_counter() - start
                rest = await resp.read()
                total = time.perf_counter() - start
                if resp.status != 200 or not (first + rest).endswith(b"data: [DONE]\n\n"):
                    raise RuntimeError(f"{url}: bad paced stream (status {resp.status})")
            if i >= 3:
                ttfbs.append(ttfb)
                totals.append(total)
    return ttfbs, totals


class Processes:
    """Every process this script starts, stopped by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen] = []
        self.descendants: list[psutil.Process] = []  # e.g. the router's worker processes

    def spawn(self, name: str, cmd: list[str]) -> tuple[subprocess.Popen, Path]:
        log_path = self.tmp / f"{name}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.started.append(proc)
        return proc, log_path

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for child in self.descendants:  # only if its parent did not stop it
            with contextlib.suppress(psutil.Error):
                if child.is_running():
                    os.kill(child.pid, signal.SIGKILL)


def wait_until(check, proc: subprocess.Popen, log_path: Path, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{what} exited with {proc.returncode}: {' | '.join(tail)}")
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout:g} s")


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def start_backend(procs: Processes, index: int) -> tuple[str, psutil.Process]:
    port = free_port()
    proc, log = procs.spawn(f"backend{index}",
                            [sys.executable, __file__, "--backend", str(port)])
    url = f"http://{HOST}:{port}"
    wait_until(lambda: http_get(url + "/health")[0] == 200, proc, log, f"backend {index}")
    return url, psutil.Process(proc.pid)


def listening(proc: psutil.Process, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in proc.net_connections(kind="tcp"))


def start_omni(procs: Processes, name: str, backends: list[str], workers: int,
               log_level: str) -> Target:
    port = free_port()
    args = ["router", *(a for url in backends for a in ("--replica", url)), "--port", str(port),
            "--policy", "round_robin", "--workers", str(workers), "--log-level", log_level,
            "--drain-timeout", "2"]
    proc, log = procs.spawn(name, [sys.executable, "-m", "omni_dp", *args])
    url = f"http://{HOST}:{port}"
    parent = psutil.Process(proc.pid)

    def ready() -> bool:
        if http_get(url + "/ready")[0] != 200:
            return False
        if workers == 1:
            return True
        kids = [k for k in parent.children() if listening(k, port)]
        return len(kids) >= workers

    wait_until(ready, proc, log, name)
    tree = [parent, *parent.children(recursive=True)]
    procs.descendants.extend(tree[1:])
    return Target(name, url + "/generate", "python -m omni_dp " + " ".join(args), tree)


def start_sglang(procs: Processes, python: str, backends: list[str]) -> Target:
    """sglang-router 0.3.2: round robin, its default retries, circuit breaker and health."""
    return _start_rust_gateway(procs, "sglang", "sglang-router",
                               [python, "-m", "sglang_router.launch_router"],
                               "python -m sglang_router.launch_router", backends)


def start_smg(procs: Processes, smg: str, backends: list[str]) -> Target:
    """smg (the SGLang Model Gateway's own package) with the flags its `launch --help` lists,
    set like sglang-router's: round robin, default retries, circuit breaker and health."""
    return _start_rust_gateway(procs, "smg", "smg", [smg, "launch"], "smg launch", backends)


def _start_rust_gateway(procs: Processes, name: str, label: str, program: list[str],
                        shown: str, backends: list[str]) -> Target:
    """The two Rust gateways take the same flags and answer the same readiness call."""
    port, metrics_port = free_port(), free_port()
    args = ["--worker-urls", *backends, "--policy", "round_robin", "--host", HOST,
            "--port", str(port), "--prometheus-host", HOST, "--prometheus-port",
            str(metrics_port), "--log-level", "warn", "--shutdown-grace-period-secs", "2"]
    proc, log = procs.spawn(name, [*program, *args])
    url = f"http://{HOST}:{port}"

    def ready() -> bool:
        status, body = http_get(url + "/readiness")
        return status == 200 and json.loads(body).get("healthy_workers") == len(backends)

    wait_until(ready, proc, log, label, timeout=90)
    parent = psutil.Process(proc.pid)
    tree = [parent, *parent.children(recursive=True)]
    procs.descendants.extend(tree[1:])
    return Target(name, url + "/generate", f"{shown} " + " ".join(args), tree)


def smg_version(smg: str) -> str | None:
    """`smg --version` ("smg 1.13.0"), or None when there is no such executable."""
    try:
        out = subprocess.run([smg, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = out.stdout.split()
    return words[-1] if out.returncode == 0 and words else None


def start_relay(procs: Processes, backends: list[str]) -> Target:
    port = free_port()
    proc, log = procs.spawn("relay", [sys.executable, __file__, "--relay", str(port), *backends])
    url = f"http://{HOST}:{port}"
    wait_until(lambda: http_get(url + "/health")[0] == 200, proc, log, "relay")
    return Target("relay", url + "/generate", "router_targets.py --relay PORT BACKEND...",
                  [psutil.Process(proc.pid)])


def sglang_version(python: str) -> str | None:
    code = "import importlib.metadata as m; print(m.version('sglang-router'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def ms(values: list[float], q: float) -> float:
    """The q-th percentile in milliseconds (nan when there is none)."""
    value = percentile(values, q)
    return float("nan") if value is None else value * 1000


if __name__ == "__main__":
    if sys.argv[1:2] == ["--backend"]:
        run_backend(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--relay"]:
        run_relay(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1:2] == ["--loadgen-child"]:
        run_loadgen_child(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: router_targets.py --backend PORT | --relay PORT URL... | "
                 "--loadgen-child SPEC")
