"""Requests/s and real-time factor of the trained voice: 1 vs 2 replicas behind the router.

For each configuration: `omni-dp launch --replicas N --detach -- --model joe` (--cpu-blocks
auto: one replica on every core, or one core each). The voice is named, not left to serve's
default: where it is not installed, the default is the seeded tiny, and its figures would be
given as the voice's; named, the launch fails and says why. `NvK` places each replica's voice
stage in K stage processes of its own (`--voice.process voice --voice.replicas K` after the
model) instead of its front's worker threads. A few warm-up requests, then a fixed number of
whole-WAV requests at a fixed concurrency through the router, then `omni-dp down`. Real-time
factor (RTF) = seconds spent / seconds of audio made: for the run (wall time over all audio:
below 1 is faster than real time) and per request (latency over its own audio, the median).

    python bench/voice.py --configs 1,1v2,2,1,1v2,2 --requests 48 --out bench/results
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import soundfile

MODEL = "joe"  # the trained voice (docs/voice.md)
TEXTS = (
    "Please call me back in the morning.",
    "Several replicas share one machine behind a router. Each one speaks on its own.",
    "The weather is very nice today, so we will walk to the station.",
    "Thank you very much for your help.",
)


def omni_dp(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def speak(url: str, text: str) -> tuple[float, float]:
    """(seconds to the whole answer, seconds of audio in it)."""
    body = json.dumps({"input": text, "response_format": "wav", "stream": False}).encode()
    request = urllib.request.Request(url + "/v1/audio/speech", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as answer:
        audio = answer.read()
    elapsed = time.perf_counter() - started
    samples, rate = soundfile.read(io.BytesIO(audio))
    return elapsed, len(samples) / rate


def measure(url: str, requests: int, concurrency: int) -> dict:
    """The load: `requests` requests, `concurrency` at a time, the texts in turn."""
    texts = [TEXTS[i % len(TEXTS)] for i in range(requests)]
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda t: speak(url, t), texts[:concurrency]))  # warm-up
        started = time.perf_counter()
        results = list(pool.map(lambda t: speak(url, t), texts))
        wall = time.perf_counter() - started
    audio = sum(r[1] for r in results)
    return {"requests": requests, "concurrency": concurrency, "wall_s": round(wall, 2),
            "req_per_s": round(requests / wall, 2), "audio_s": round(audio, 1),
            "rtf_run": round(wall / audio, 4),
            "rtf_request_p50": round(statistics.median(r[0] / r[1] for r in results), 4),
            "latency_p50_s": round(statistics.median(r[0] for r in results), 3)}


def free_ports(count: int, start: int) -> int:
    """The first of `count` consecutive loopback ports free now, from `start` on (the machine
    is shared: a fixed block may be taken)."""
    for base in range(start, start + 2000, count):
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports from {start}")


def parse_config(token: str) -> tuple[int, int]:
    """`2` → 2 replicas, the voice in each front; `1v2` → 1 replica, its voice in 2 processes."""
    replicas, _, processes = token.partition("v")
    return int(replicas), int(processes or 0)


def engine_args(token: str) -> list[str]:
    """What every replica of configuration `token` serves: the voice, named rather than left
    to serve's default, and its voice stage in K processes for `NvK`."""
    _, processes = parse_config(token)
    placed = ["--voice.process", "voice", "--voice.replicas", str(processes)] if processes else []
    return ["--", "--model", MODEL, *placed]


def run_config(token: str, args: argparse.Namespace, state: str) -> dict:
    replicas, processes = parse_config(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_DP_")}
    env["OMNI_DP_STATE_DIR"] = state
    run_id = f"voice-{token}-{os.getpid()}-{int(time.time())}"
    base = free_ports(replicas + 1, args.base_port)
    router_port = base + replicas
    started = time.perf_counter()
    launched = omni_dp("launch", "--replicas", str(replicas), "--detach", "--run-id", run_id,
                       "--gpu", "none", "--base-port", str(base),
                       "--router-port", str(router_port), *engine_args(token), env=env)
    row: dict = {"config": token, "model": MODEL, "replicas": replicas,
                 "voice_processes": processes,
                 "up_s": round(time.perf_counter() - started, 1)}
    try:
        if launched.returncode != 0:
            return {**row, "error": launched.stderr[-400:]}
        row |= measure(f"http://127.0.0.1:{router_port}", args.requests, args.concurrency)
    finally:
        omni_dp("down", run_id, env=env, timeout=120)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="1,2",
                        help="replica counts, in order; NvK: the voice in K processes each")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--base-port", type=int, default=18300)
    parser.add_argument("--out", type=Path, default=None, help="folder for voice.jsonl")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="odp-voice-") as state:
        for token in args.configs.split(","):
            row = run_config(token, args, state)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "voice.jsonl", "a") as out:
            for row in rows:
                out.write(json.dumps({**row, "cpus": os.cpu_count(),
                                      "machine": platform.machine()}) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
