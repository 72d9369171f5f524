"""What --migration-limit costs the router: CPU per streamed chunk of an LLM stream, on vs off.

Two stand-in replicas (`python migration_overhead.py --backend PORT`) answer streamed
completions in vLLM 0.32's chunks (one token a chunk, the ids when `return_token_ids` is asked,
a usage chunk and [DONE]); `omni-dp router` runs in front of them with `--migration-limit 0`
(off: every chunk relayed untouched), `--migration-limit 1` (on: each request's body parsed and
given `"return_token_ids": true`, every chunk parsed, its ids kept and nulled, re-serialised)
and on with a client that asks for the ids itself (the chunks go out as they came). A client
in its own process drives C streams at a time for D seconds per run; the router's CPU (its
threads' schedstat) over the chunks it relayed is the figure. Runs are interleaved, R rounds.

    .venv/bin/python bench/migration_overhead.py --record bench/results/migration.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from router_targets import HOST, Processes, free_port, http_get, sched_cpu_seconds, wait_until

TOKENS = 64  # chunks of tokens per answer (vllm bench serve's 64-token completions)
MODES = {  # name: (router flags, the client asks for the token ids itself)
    "off": (["--migration-limit", "0"], False),
    "on": (["--migration-limit", "1"], False),
    "on, ids asked": (["--migration-limit", "1"], True),
}


def run_backend(port: int, pace_s: float) -> None:
    """A stand-in vLLM replica: streamed completions in its chunk shapes, `pace_s` apart."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        ids = bool(body.get("return_token_ids"))
        prompt = [1, 473, 280, 282, 375, 311, 325, 90]
        head = {"id": "cmpl-bench", "object": "text_completion", "created": 1796521353,
                "model": body.get("model")}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(TOKENS):
            if pace_s and i:
                await asyncio.sleep(pace_s)
            choice = {"index": 0, "text": " tok", "logprobs": None,
                      "finish_reason": "length" if i == TOKENS - 1 else None,
                      "stop_reason": None,
                      "prompt_token_ids": prompt if ids and i == 0 else None,
                      "token_ids": [300 + i] if ids else None}
            await response.write(b"data: " + json.dumps(
                {**head, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n")
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + TOKENS,
                 "completion_tokens": TOKENS}
        await response.write(b"data: " + json.dumps(
            {**head, "choices": [], "usage": usage, "system_fingerprint": "bench"},
            separators=(",", ":")).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def run_client(spec: dict) -> None:
    """C streams at a time for D seconds: (streams done, chunks read, failures)."""

    async def drive() -> dict:
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": TOKENS,
                           "stream": True, "stream_options": {"include_usage": True},
                           **({"return_token_ids": True} if spec["ids"] else {})}).encode()
        done = chunks = failed = 0
        deadline = time.monotonic() + spec["duration"]
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def client() -> None:
                nonlocal done, chunks, failed
                while time.monotonic() < deadline:
                    async with session.post(spec["url"], data=body, headers=headers) as resp:
                        text = await resp.read()
                    if resp.status != 200 or not text.endswith(b"data: [DONE]\n\n"):
                        failed += 1
                    done += 1
                    chunks += text.count(b"data: ")

            await asyncio.gather(*(client() for _ in range(spec["concurrency"])))
        return {"streams": done, "chunks": chunks, "failed": failed}

    print(json.dumps(asyncio.run(drive())))


def start_router(procs: Processes, name: str, backends: list[str], flags: list[str]):
    port = free_port()
    args = ["router", *(a for url in backends for a in ("--replica", url)), "--port", str(port),
            "--policy", "round_robin", "--log-level", "warning", "--drain-timeout", "2", *flags]
    proc, log = procs.spawn(name, [sys.executable, "-m", "omni_dp", *args])
    url = f"http://{HOST}:{port}"
    wait_until(lambda: http_get(url + "/ready")[0] == 200, proc, log, name)
    return url, psutil.Process(proc.pid)


def measure(url: str, router: psutil.Process, ids: bool, args) -> dict:
    spec = {"url": url + "/v1/completions", "ids": ids, "concurrency": args.concurrency,
            "duration": args.duration}
    before = sched_cpu_seconds([router])
    out = subprocess.run([sys.executable, __file__, "--client", json.dumps(spec)],
                         capture_output=True, text=True, timeout=args.duration + 60, check=True)
    cpu = sched_cpu_seconds([router]) - before
    result = json.loads(out.stdout)
    result["router_cpu_s"] = cpu
    result["us_per_chunk"] = 1e6 * cpu / max(result["chunks"], 1)
    return result


def markdown(results: dict[str, list[dict]], args) -> str:
    head = (f"### {time.strftime('%Y-%m-%d %H:%M')} — {os.cpu_count()} CPUs "
            f"({platform.machine()}), Python {platform.python_version()}\n\n"
            f"`bench/migration_overhead.py`: 2 stand-in vLLM replicas, {TOKENS}-token streamed "
            f"completions (one token a chunk, plus usage and [DONE]"
            + (f", {args.pace_ms:g} ms apart" if args.pace_ms else ", unpaced")
            + f"), {args.concurrency} "
            f"streams at a time, {args.duration:g} s a run, {args.rounds} rounds interleaved; "
            "the router's CPU (schedstat) over the chunks it relayed.\n\n"
            "| mode | router µs per chunk (median, range) | streams | failed |\n"
            "|---|---|---:|---:|\n")
    rows = []
    for mode, runs in results.items():
        per = [r["us_per_chunk"] for r in runs]
        rows.append(f"| {mode} | {statistics.median(per):.1f} ({min(per):.1f}–{max(per):.1f}) "
                    f"| {sum(r['streams'] for r in runs)} | {sum(r['failed'] for r in runs)} |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="between a stream's chunks (an engine's decode step); 0: at once")
    parser.add_argument("--record", default=None, help="append the table to this file")
    parser.add_argument("--backend", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend:
        run_backend(args.backend, args.pace_ms / 1000)
        return 0
    if args.client:
        run_client(json.loads(args.client))
        return 0
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    # The processes' logs, removed with the directory once they are stopped.
    with tempfile.TemporaryDirectory(prefix="odp-migration-cpu-") as work:
        procs = Processes(Path(work))
        try:
            backends = []
            for i in range(2):
                port = free_port()
                proc, log = procs.spawn(f"backend{i}", [sys.executable, __file__, "--backend",
                                                        str(port), "--pace-ms", str(args.pace_ms)])
                url = f"http://{HOST}:{port}"
                wait_until(lambda u=url: http_get(u + "/health")[0] == 200, proc, log, "backend")
                backends.append(url)
            routers = {mode: start_router(procs, f"router-{i}", backends, flags)
                       for i, (mode, (flags, _)) in enumerate(MODES.items())}
            for _ in range(args.rounds):
                for mode, (_, ids) in MODES.items():
                    result = measure(*routers[mode], ids, args)
                    print(mode, json.dumps(result), flush=True)
                    results[mode].append(result)
        finally:
            with contextlib.suppress(Exception):
                procs.stop_all()
    table = markdown(results, args)
    print(table)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
