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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def drive(url: str, concurrency: int, num_requests: int, sample_rate: int) -> LevelResult:
    latencies, ttfas = [], []
    audio_bytes = 0
    errors = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal next_index, audio_bytes, errors
            while next_index < num_requests:
                i = next_index
                next_index += 1
                body = {"input": TEXTS[i % len(TEXTS)], "seed": i, "stream": True,
                        "response_format": "pcm"}
                start = time.perf_counter()
                first = None
                size = 0
                try:
                    async with session.post(url + "/v1/audio/speech", json=body) as resp:
                        if resp.status != 200:
                            errors += 1
                            await resp.read()
                            continue
                        async for chunk in resp.content.iter_any():
                            first = first or time.perf_counter()
                            size += len(chunk)
                except aiohttp.ClientError:
                    errors += 1  # a reset or refused connection is a failed request, counted
                    continue
                end = time.perf_counter()
                latencies.append(end - start)
                ttfas.append((first or end) - start)
                audio_bytes += size

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started

    done = len(latencies)
    latencies, ttfas = latencies or [float("nan")], ttfas or [float("nan")]  # all failed
    return LevelResult(
        concurrency=concurrency, requests=done, errors=errors, wall_s=round(wall, 3),
        requests_per_s=round(done / wall, 2),
        audio_s_per_s=round(audio_bytes / 2 / sample_rate / wall, 2),
        latency_p50_ms=round(statistics.median(latencies) * 1000, 1),
        latency_p99_ms=round(percentile(latencies, 99) * 1000, 1),
        ttfa_p50_ms=round(statistics.median(ttfas) * 1000, 1),
        ttfa_p99_ms=round(percentile(ttfas, 99) * 1000, 1),
    )


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
            with urllib.request.urlopen(url + "/get_server_info") as resp:
                sample_rate = json.load(resp)["model"]["sample_rate"]
            asyncio.run(drive(url, 2, 8, sample_rate))  # warm-up, not reported
            results = []
            replica = psutil.Process(proc.pid)
            client = psutil.Process()
            for level in (int(c) for c in args.concurrency.split(",")):
                replica_before, client_before = cpu_seconds(replica), cpu_seconds(client)
                result = asyncio.run(drive(url, level, args.requests, sample_rate))
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
