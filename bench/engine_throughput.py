"""Throughput of ONE replica: requests/s, audio-seconds/s, latency and time to first audio.

Starts `omni-dp serve` (tiny, CPU, 1 thread by default) on a free loopback port, drives it with
streamed requests at each concurrency level for a fixed number of requests, prints a table and
optionally appends it to a results file. Every request is a streamed PCM request, so the time to
the first audio chunk is measured on the same requests as the latency.

    .venv/bin/python bench/engine_throughput.py --record bench/results/engine.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

from omni_dp.bench.load import send
from omni_dp.bench.results import RequestResult
from omni_dp.bench.stats import percentile
from omni_dp.bench.workload import Workload

# Short texts of varied length, like a TTS service's traffic of prompts and replies.
TEXTS = [
    "Hello there.",
    "Your order has shipped.",
    "The meeting starts in five minutes.",
    "Turn left at the next intersection.",
    "It will rain this afternoon.",
    "Thank you for calling.",
    "Please hold while I connect you.",
    "Battery low.",
]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    audio_s_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttfa_p50_ms: float
    ttfa_p99_ms: float
    replica_cpu_ms_per_req: float = 0.0  # user+system CPU of the replica process
    client_cpu_ms_per_req: float = 0.0  # ... and of this load generator


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# The requests: omni-dp bench's streamed-PCM workload over the texts above, request i the same
# in every run (placement.py compares forms on exactly the same requests).
WORKLOAD = Workload(kind="speech-stream", texts=tuple(TEXTS), seed=0)
REQUEST_TIMEOUT_S = 120.0


async def drive(url: str, concurrency: int, num_requests: int,
                workload: Workload = WORKLOAD) -> LevelResult:
    """A closed loop of `concurrency` clients until `num_requests` were sent; each request is
    sent, timed and classified by omni-dp bench's own sender, so these numbers and the
    command's are made alike."""
    results: list[RequestResult] = []
    indices = iter(range(num_requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def client() -> None:
            for i in indices:
                path, body = workload.request(i)
                results.append(await send(session, url.rstrip("/") + path, body, workload,
                                          REQUEST_TIMEOUT_S))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return level_result(concurrency, results, wall)


def level_result(concurrency: int, results: list[RequestResult], wall: float) -> LevelResult:
    ok = [r for r in results if r.outcome == "ok"]
    latencies = [r.latency_s for r in ok]
    firsts = [r.ttfb_s if r.ttfb_s is not None else r.latency_s for r in ok]

    def ms(values: list[float], q: float) -> float:
        value = percentile(values, q)
        return float("nan") if value is None else round(value * 1000, 1)  # none succeeded

    return LevelResult(
        concurrency=concurrency, requests=len(ok), errors=len(results) - len(ok),
        wall_s=round(wall, 3), requests_per_s=round(len(ok) / wall, 2),
        audio_s_per_s=round(sum(r.audio_s for r in ok) / wall, 2),
        latency_p50_ms=ms(latencies, 50), latency_p99_ms=ms(latencies, 99),
        ttfa_p50_ms=ms(firsts, 50), ttfa_p99_ms=ms(firsts, 99))


def start_replica(serve_args: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_dp", "serve", "--port", "0", *serve_args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"replica exited with {proc.returncode}:\n{log_path.read_text()}")
        match = url or re.search(r"listening on (http://[\d.]+:\d+)", log_path.read_text())
        if match:
            url = url or match.group(1)
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"replica did not become healthy:\n{log_path.read_text()}")


def markdown(results: list[LevelResult], header: dict) -> str:
    lines = [
        f"### {header['date']} — {header['machine']}",
        "",
        f"replica: `omni-dp serve {' '.join(header['serve_args'])}` · "
        f"requests per level: {header['requests']} · client: aiohttp on the same machine",
        "",
        "| concurrency | requests | errors | req/s | audio s/s | p50 ms | p99 ms "
        "| TTFA p50 ms | TTFA p99 ms | replica CPU ms/req | client CPU ms/req |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.requests} | {r.errors} | {r.requests_per_s} | "
            f"{r.audio_s_per_s} | {r.latency_p50_ms} | {r.latency_p99_ms} | "
            f"{r.ttfa_p50_ms} | {r.ttfa_p99_ms} | {r.replica_cpu_ms_per_req} | "
            f"{r.client_cpu_ms_per_req} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=64, help="requests per level")
    parser.add_argument("--serve-args", default="--model tiny --device cpu --threads 1",
                        help="flags for `omni-dp serve` (the port is chosen here)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--record", type=Path, help="append the markdown table to this file")
    args = parser.parse_args()

    serve_args = args.serve_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_replica(serve_args, Path(tmp) / "replica.log")
        try:
            asyncio.run(drive(url, 2, 8))  # warm-up, not reported
            results = []
            replica = psutil.Process(proc.pid)
            client = psutil.Process()
            for level in (int(c) for c in args.concurrency.split(",")):
                replica_before, client_before = cpu_seconds(replica), cpu_seconds(client)
                result = asyncio.run(drive(url, level, args.requests))
                done = max(result.requests, 1)
                result.replica_cpu_ms_per_req = round(
                    (cpu_seconds(replica) - replica_before) / done * 1000, 1)
                result.client_cpu_ms_per_req = round(
                    (cpu_seconds(client) - client_before) / done * 1000, 1)
                results.append(result)
                print(f"concurrency {level}: {result.requests_per_s} req/s", file=sys.stderr)
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(60)

    header = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}",
        "serve_args": serve_args,
        "requests": args.requests,
    }
    if args.json:
        print(json.dumps({**header, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(markdown(results, header))
    if args.record:
        with args.record.open("a") as out:
            out.write("\n" + markdown(results, header))


if __name__ == "__main__":
    main()
