"""Router overhead: what one hop through `omni-dp router` costs, next to direct and sglang-router.

Starts two trivial aiohttp backends on 127.0.0.1 (this script in `--backend PORT` mode), then the
targets: direct (one backend), `omni-dp router --workers 1`, `--workers 2`, `--workers 1` with
`--log-level info` (the per-request route line on), and sglang-router when a throwaway venv holds
it (`--sglang-python`, never a project dependency). Drives every target with the same load,
interleaved, for a fixed duration per run:

    json c=1 / c=32     POST /generate answered with ~200 bytes of JSON at once
    sse  c=1 / c=32     20 SSE `data:` events + `data: [DONE]`, unpaced
    paced-ttfb c=1      the same events 5 ms apart; a Python client timestamps the first body byte

and reports req/s, p50/p99 latency, CPU ms per request of the hop's process tree (for "direct":
the backend itself) and streamed time to first byte. Everything started is stopped by pid.

    .venv/bin/python bench/router_overhead.py --record bench/results/router.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import aiohttp
import psutil

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
GEN_START, GEN_END = "<!-- router_overhead.py: generated -->", "<!-- end generated -->"


# --- the backend (`--backend PORT`) --------------------------------------------------------


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
    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    for path in ("/get_server_info", "/get_model_info"):  # sglang-router's discovery calls
        app.router.add_get(path, lambda r: web.json_response(info))
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


# --- the Python load generator (`--loadgen-child SPEC`, used only when wrk is missing) -------


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
                "p50_ms": percentile(latencies, 50) * 1000,
                "p99_ms": percentile(latencies, 99) * 1000}

    print(json.dumps(asyncio.run(drive())))


# --- measuring -----------------------------------------------------------------------------


@dataclass
class Target:
    name: str  # short key: direct, omni-w1, omni-w2, omni-w1-info, sglang
    url: str
    command: str  # how it was started, for the record
    procs: list[psutil.Process] = field(default_factory=list)  # the hop's CPU is theirs


@dataclass
class RunResult:
    scenario: str
    concurrency: int
    target: str
    repetition: int
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_req: float
    ttfb_ms: float | None = None  # paced-ttfb only: median time to the first body byte
    stream_ms: float | None = None  # paced-ttfb only: median time to the end of the stream


@dataclass(frozen=True)
class Scenario:
    name: str  # json, sse, paced-ttfb
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.name} c={self.concurrency}"


SCENARIOS = [Scenario("json", 1), Scenario("json", 32), Scenario("sse", 1), Scenario("sse", 32),
             Scenario("paced-ttfb", 1)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


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


# --- starting and stopping -----------------------------------------------------------------


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
    port, metrics_port = free_port(), free_port()
    args = ["--worker-urls", *backends, "--policy", "round_robin", "--host", HOST,
            "--port", str(port), "--prometheus-host", HOST, "--prometheus-port",
            str(metrics_port), "--log-level", "warn", "--shutdown-grace-period-secs", "2"]
    proc, log = procs.spawn("sglang", [python, "-m", "sglang_router.launch_router", *args])
    url = f"http://{HOST}:{port}"

    def ready() -> bool:
        status, body = http_get(url + "/readiness")
        return status == 200 and json.loads(body).get("healthy_workers") == len(backends)

    wait_until(ready, proc, log, "sglang-router", timeout=90)
    parent = psutil.Process(proc.pid)
    tree = [parent, *parent.children(recursive=True)]
    procs.descendants.extend(tree[1:])
    return Target("sglang", url + "/generate",
                  "python -m sglang_router.launch_router " + " ".join(args), tree)


def sglang_version(python: str) -> str | None:
    code = "import importlib.metadata as m; print(m.version('sglang-router'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# --- the run -------------------------------------------------------------------------------


def run_one(target: Target, scenario: Scenario, rep: int, args, tmp: Path) -> RunResult:
    if scenario.name == "paced-ttfb":
        before = sched_cpu_seconds(target.procs)
        started = time.perf_counter()
        ttfbs, totals = asyncio.run(measure_ttfb(target.url, args.ttfb_requests))
        wall = time.perf_counter() - started
        done = len(ttfbs) + 3
        cpu = sched_cpu_seconds(target.procs) - before
        return RunResult(
            scenario.name, 1, target.name, rep, len(ttfbs), 0, round(done / wall, 1),
            round(statistics.median(totals) * 1000, 2), round(percentile(totals, 99) * 1000, 2),
            round(cpu / done * 1000, 3),
            ttfb_ms=round(statistics.median(ttfbs) * 1000, 2),
            stream_ms=round(statistics.median(totals) * 1000, 1),
        )
    body = BODIES[scenario.name]
    before = cpu_seconds(target.procs)
    if args.loadgen == "wrk":
        out = run_wrk(target.url, scenario.concurrency, args.duration, body, tmp)
    else:
        out = run_python_loadgen(target.url, scenario.concurrency, args.duration, body)
    cpu = cpu_seconds(target.procs) - before
    done = max(out["requests"], 1)
    return RunResult(
        scenario.name, scenario.concurrency, target.name, rep, out["requests"], out["errors"],
        round(out["requests_per_s"], 1), round(out["p50_ms"], 3), round(out["p99_ms"], 3),
        round(cpu / done * 1000, 3),
    )


LABELS = {
    "direct": "direct (one backend)",
    "omni-w1": "omni-dp --workers 1",
    "omni-w2": "omni-dp --workers 2",
    "omni-w1-info": "omni-dp --workers 1, log info",
    "sglang": "sglang-router",
}


def _fmt(values: list[float], digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def _median(results: list[RunResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def summarise(results: list[RunResult], targets: list[str]) -> dict:
    """Per (scenario key, target): the runs, in repetition order."""
    table: dict[str, dict[str, list[RunResult]]] = {}
    for r in results:
        key = f"{r.scenario} c={r.concurrency}"
        table.setdefault(key, {}).setdefault(r.target, []).append(r)
    return {k: {t: sorted(v[t], key=lambda r: r.repetition) for t in targets if t in v}
            for k, v in table.items()}


def goals(summary: dict) -> list[str]:
    lines = []
    cpu_rows = [(key, t, _median(summary[key][t], "cpu_ms_per_req"))
                for key in ("json c=1", "json c=32") if key in summary
                for t in ("omni-w1", "omni-w2") if t in summary[key]]
    if cpu_rows:
        worst = max(c for *_, c in cpu_rows)
        detail = "; ".join(f"{LABELS[t]} {key}: {c:.3f}" for key, t, c in cpu_rows)
        sgl = [f"sglang-router {key}: {_median(summary[key]['sglang'], 'cpu_ms_per_req'):.3f}"
               for key in ("json c=1", "json c=32") if "sglang" in summary.get(key, {})]
        lines.append(
            f"- **Router CPU ≤ 0.15 ms per small request: {'MET' if worst <= 0.15 else 'NOT MET'}"
            f"** (median ms/req — {detail}{'; for comparison ' + '; '.join(sgl) if sgl else ''})."
        )
    paced = summary.get("paced-ttfb c=1", {})
    if "direct" in paced:
        parts, ok = [], True
        for t in ("omni-w1", "omni-w2", "sglang"):
            if t not in paced:
                continue
            over = [r.ttfb_ms - d.ttfb_ms for r, d in zip(paced[t], paced["direct"], strict=False)]
            over_med = statistics.median(over)
            if t != "sglang":
                ok = ok and over_med <= 1.0
            parts.append(f"{LABELS[t]} +{_fmt(over, 2)} ms")
        direct = _fmt([r.ttfb_ms for r in paced["direct"]], 2)
        lines.append(
            f"- **Streamed TTFB overhead ≤ 1 ms (omni-dp): {'MET' if ok else 'NOT MET'}** "
            f"(direct {direct} ms; overhead per repetition: {'; '.join(parts)})."
        )
    rows = []
    for key in ("json c=1", "json c=32", "sse c=1", "sse c=32"):
        cell = summary.get(key, {})
        if "omni-w2" in cell and "sglang" in cell:
            w2, sg = _median(cell["omni-w2"], "requests_per_s"), _median(cell["sglang"],
                                                                         "requests_per_s")
            rows.append((key, w2, sg))
    if rows:
        met = [k for k, w2, sg in rows if w2 >= sg]
        missed = [k for k, w2, sg in rows if w2 < sg]
        detail = "; ".join(f"{k}: {w2:.0f} vs {sg:.0f} req/s" for k, w2, sg in rows)
        verdict = "MET" if not missed else ("NOT MET" if not met else "PARTLY MET")
        lines.append(
            f"- **`--workers 2` throughput ≥ sglang-router's: {verdict}** (medians, omni-dp "
            f"--workers 2 vs sglang-router — {detail}"
            + (f"; met for {', '.join(met)}, missed for {', '.join(missed)}" if missed and met
               else "") + ")."
        )
    elif summary:
        lines.append("- **`--workers 2` throughput ≥ sglang-router's: not evaluated** "
                     "(sglang-router was not measured in this run).")
    return lines


HOW_TO_READ = """\
How to read: every target runs on this same 2-core machine as the two backends and the load
generator, so req/s at c=32 is mostly a measure of who gets the CPU and swings between runs;
compare **CPU ms/req** (Δ user+system of the hop's process tree ÷ requests; for "direct" it is
the backend's own cost, i.e. what one extra aiohttp hop roughly costs) and the **TTFB** rows.
Values separated by "/" are the repetitions, in order; runs were interleaved (target order
rotated per scenario and repetition). "log info" is `--workers 1` with the per-request JSON route
line written to stderr (a file here), to show what that line costs. sglang-router's unpaced
SSE at c=1 and its TTFB are dominated by a ~40 ms delayed-ACK stall (it does not set TCP_NODELAY
on client sockets; see router-facts.md §4 in the project's shared notes), not by CPU."""


def markdown(summary: dict, header: dict, goal_lines: list[str]) -> str:
    lines = [
        f"### {header['date']} — {header['machine']}",
        "",
        f"Python {header['python']} · aiohttp {header['aiohttp']} · uvloop {header['uvloop']} "
        f"(routers and backends use it) · load generator: {header['loadgen']} · "
        f"{header['duration']:g} s per run · {header['repetitions']} repetitions · "
        f"TTFB: median of {header['ttfb_requests']} paced requests (aiohttp client, first body "
        "byte)",
        "",
        "Targets:",
        "",
    ]
    for name, command in header["targets"].items():
        lines.append(f"- {LABELS.get(name, name)}: `{command}`")
    for name, why in header["skipped"].items():
        lines.append(f"- {LABELS.get(name, name)}: **not measured** — {why}")
    lines += ["", "| load | conc | target | req/s | p50 ms | p99 ms | CPU ms/req | errors |",
              "|---|---:|---|---|---:|---:|---|---:|"]
    for key, cells in summary.items():
        if key.startswith("paced"):
            continue
        name, conc = key.split(" c=")
        for target, runs in cells.items():
            lines.append(
                f"| {name} | {conc} | {LABELS.get(target, target)} | "
                f"{_fmt([r.requests_per_s for r in runs], 0)} | "
                f"{_median(runs, 'p50_ms'):.2f} | {_median(runs, 'p99_ms'):.2f} | "
                f"{_fmt([r.cpu_ms_per_req for r in runs], 3)} | {sum(r.errors for r in runs)} |"
            )
    paced = summary.get("paced-ttfb c=1")
    if paced:
        lines += ["", f"Streamed TTFB: {EVENTS} SSE events {PACE_S * 1000:g} ms apart, "
                  "concurrency 1, one keep-alive connection.", "",
                  "| target | TTFB ms (median) | overhead vs direct ms | stream ms (median) "
                  "| CPU ms/req (schedstat) |", "|---|---|---|---:|---|"]
        direct = paced.get("direct")
        for target, runs in paced.items():
            over = ("—" if direct is None or target == "direct" else _fmt(
                [r.ttfb_ms - d.ttfb_ms for r, d in zip(runs, direct, strict=False)], 2))
            lines.append(
                f"| {LABELS.get(target, target)} | {_fmt([r.ttfb_ms for r in runs], 2)} | "
                f"{over} | {_median(runs, 'stream_ms'):.1f} | "
                f"{_fmt([r.cpu_ms_per_req for r in runs], 3)} |"
            )
    lines += ["", "Goals (from the issue):", "", *goal_lines, "", HOW_TO_READ]
    return "\n".join(lines) + "\n"


def record(path: Path, text: str) -> None:
    """Replace the generated block; keep whatever was written around it by hand."""
    block = f"{GEN_START}\n{text}{GEN_END}\n"
    if path.exists():
        old = path.read_text()
        if GEN_START in old and GEN_END in old:
            head, rest = old.split(GEN_START, 1)
            tail = rest.split(GEN_END, 1)[1].lstrip("\n")
            path.write_text(head + block + ("\n" + tail if tail else ""))
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Router overhead: loopback, 2 trivial backends\n\n"
                    "Reproduce: `.venv/bin/python bench/router_overhead.py --record "
                    f"{path}`\n\n{block}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--ttfb-requests", type=int, default=20,
                        help="paced requests per TTFB measurement (after 3 warm-up)")
    parser.add_argument("--targets", default="direct,omni-w1,omni-w2,omni-w1-info,sglang",
                        help="comma-separated subset of: " + ", ".join(LABELS))
    parser.add_argument("--scenarios", default=",".join(s.key.replace(" c=", ":")
                                                        for s in SCENARIOS),
                        help="comma-separated NAME:CONCURRENCY (json, sse, paced-ttfb)")
    parser.add_argument("--sglang-python", default="/tmp/sgl-venv/bin/python",
                        help="python of a throwaway venv holding sglang-router (not a project "
                             "dependency)")
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto",
                        help="auto: wrk when on PATH, else an aiohttp client in its own process")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--record", type=Path, help="write the results into this markdown file")
    parser.add_argument("--backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend is not None:
        return run_backend(args.backend)
    if args.loadgen_child is not None:
        return run_loadgen_child(json.loads(args.loadgen_child))

    if args.loadgen == "auto":
        args.loadgen = "wrk" if shutil.which("wrk") else "python"
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(wanted) - set(LABELS))
    if unknown:
        parser.error(f"unknown target(s): {', '.join(unknown)}")
    scenarios = []
    for item in args.scenarios.split(","):
        name, _, conc = item.strip().partition(":")
        if name not in ("json", "sse", "paced-ttfb"):
            parser.error(f"unknown scenario {item!r}")
        scenarios.append(Scenario(name, int(conc or 1)))

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    skipped: dict[str, str] = {}
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        procs = Processes(tmp)
        try:
            urls, backend_procs = zip(*(start_backend(procs, i) for i in range(2)), strict=True)
            targets: list[Target] = []
            for name in wanted:
                if name == "direct":
                    targets.append(Target("direct", urls[0] + "/generate",
                                          f"{Path(__file__).name} --backend PORT",
                                          [backend_procs[0]]))
                elif name.startswith("omni"):
                    workers = 2 if name == "omni-w2" else 1
                    level = "info" if name.endswith("info") else "warning"
                    targets.append(start_omni(procs, name, list(urls), workers, level))
                elif name == "sglang":
                    version = sglang_version(args.sglang_python)
                    if version is None:
                        skipped[name] = (f"no sglang-router importable by {args.sglang_python} "
                                         "(pip install sglang-router into a throwaway venv)")
                        continue
                    try:
                        target = start_sglang(procs, args.sglang_python, list(urls))
                    except RuntimeError as exc:
                        skipped[name] = f"sglang-router {version} did not start: {exc}"
                        continue
                    target.command += f"  (sglang-router {version})"
                    targets.append(target)
            runs = len(targets) * len(scenarios) * args.repetitions
            print(f"{runs} runs, about {runs * (args.duration + 1) / 60:.1f} min "
                  f"(load generator: {args.loadgen})", file=sys.stderr)
            for target in targets:  # warm-up, not reported
                for body in (BODIES["json"], BODIES["sse"]):
                    if args.loadgen == "wrk":
                        run_wrk(target.url, 8, 1, body, tmp)
                    else:
                        run_python_loadgen(target.url, 8, 1, body)
            for rep in range(args.repetitions):
                for s_index, scenario in enumerate(scenarios):
                    shift = rep + s_index
                    order = targets[shift % len(targets):] + targets[:shift % len(targets)]
                    for target in order:
                        result = run_one(target, scenario, rep, args, tmp)
                        results.append(result)
                        extra = f" ttfb {result.ttfb_ms} ms" if result.ttfb_ms else ""
                        print(f"rep {rep} {scenario.key:<14} {target.name:<13} "
                              f"{result.requests_per_s:>8} req/s p50 {result.p50_ms:.2f} ms "
                              f"cpu {result.cpu_ms_per_req:.3f} ms/req{extra}", file=sys.stderr)
        except KeyboardInterrupt:
            print("interrupted: stopping everything", file=sys.stderr)
            raise SystemExit(130) from None
        finally:
            procs.stop_all()

    names = [t.name for t in targets]
    summary = summarise(results, names)
    ordered = {s.key: summary[s.key] for s in scenarios if s.key in summary}
    wrk_version = ""
    if args.loadgen == "wrk":
        out = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
        wrk_version = (out.stdout or out.stderr).split(" [")[0].strip()
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}",
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": _version("uvloop"),
        "loadgen": (f"`{wrk_version}` (`-t1`, keep-alive, `--latency`)" if wrk_version else
                    "Python aiohttp client in a separate process (not wrk)"),
        "duration": args.duration,
        "repetitions": args.repetitions,
        "ttfb_requests": args.ttfb_requests,
        "targets": {t.name: t.command for t in targets},
        "skipped": skipped,
    }
    goal_lines = goals(ordered)
    if args.json:
        print(json.dumps({**header, "goals": goal_lines,
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(markdown(ordered, header, goal_lines))
    if args.record:
        record(args.record, markdown(ordered, header, goal_lines))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
