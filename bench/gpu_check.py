"""Checks of one replica's device path (run through bench/gpu_run.sh; `--device cpu` on CI).

Starts `omni-dp serve --device DEVICE`, then checks what CI cannot see on a GPU: the replica
reports the device for its process, the KV pool is the size asked for, a request is
reproducible, streamed and non-streamed audio match, and a batch of concurrent requests all
succeed. Then, in this process, the talker's step rate and its syncs per step (one expected on
CUDA) and the device memory a replica holds besides weights and KV (bench/engine_steps.py).

Every check runs and prints its own line (`ok` / `FAIL` / `ERROR`) as it ends, so a timeout
keeps the lines before it. Exit 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
from engine_throughput import start_replica

KV_TOKENS = 65536


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/v1/audio/speech", json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


async def concurrent(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(i: int) -> int:
            body = {"input": f"Concurrent request {i}.", "seed": i}
            async with session.post(url + "/v1/audio/speech", json=body) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one(i) for i in range(n)))


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def run(self, name: str, check: Callable[[], str | None]) -> None:
        """`check` returns a failure message, or None; what it prints is a fact."""
        started = time.perf_counter()
        try:
            failure = check()
        except Exception as exc:
            failure = f"ERROR {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        if failure:
            self.failures.append(f"{name}: {failure}")
        print(f"{'FAIL' if failure else 'ok  '} {name} ({seconds:.1f} s)"
              + (f": {failure}" if failure else ""), flush=True)


def server_checks(checks: Checks, url: str, device: str) -> None:
    info: dict = {}

    def server_info() -> str | None:
        with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
            info.update(json.load(resp))
        print(json.dumps({k: info[k] for k in ("device", "dtype", "max_total_num_tokens",
                                               "kv_cache_bytes", "processes")}), flush=True)
        wrong = [p for p in info["processes"] if not p["device"].startswith(device)]
        if not info["device"].startswith(device):
            return f"device is {info['device']}, not {device}"
        if wrong:
            return f"processes not on {device}: {wrong}"
        if info["max_total_num_tokens"] != KV_TOKENS:
            return f"KV tokens {info['max_total_num_tokens']} != {KV_TOKENS}"
        return None

    body = {"input": "The device path, checked.", "seed": 1, "response_format": "pcm"}
    audio: dict[str, bytes] = {}

    def reproducible() -> str | None:
        audio["first"], second = post(url, body), post(url, body)
        print(f"{len(audio['first'])} bytes of PCM", flush=True)
        return None if audio["first"] == second else "the same request alone gave other audio"

    def streamed() -> str | None:
        same = post(url, {**body, "stream": True}) == audio.get("first")
        return None if same else "streamed audio differs from non-streamed"

    def concurrency() -> str | None:
        statuses = asyncio.run(concurrent(url, 64))
        return None if set(statuses) == {200} else f"statuses {sorted(set(statuses))}"

    checks.run("server info: device, processes, KV", server_info)
    checks.run("a request alone is reproducible", reproducible)
    checks.run("streamed == non-streamed", streamed)
    checks.run("64 concurrent requests", concurrency)


def step_checks(checks: Checks, device: str, model: str, steps_n: int) -> None:
    from engine_steps import measure

    def steps() -> str | None:
        # warmup no longer than the count measured (a CPU rehearsal measures few)
        result = measure(device, model, batch=32, steps=steps_n, warmup=min(20, steps_n))
        print(json.dumps(result), flush=True)
        syncs = result["syncs_per_step"]
        if syncs is not None and syncs["max"] != 1:
            return f"syncs per step {syncs['per_step']}, expected exactly 1"
        planned, measured = result["planned_overhead_bytes"], result["measured_overhead_bytes"]
        if measured is not None and measured > planned:
            return (f"overhead {measured} bytes measured ({result['overhead_source']}, this "
                    f"process's CUDA context included), the plan assumes {planned}")
        return None

    checks.run("talker steps: rate, syncs per step, overhead", steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=100,
                        help="talker steps timed at batch 32 [default: 100]")
    args = parser.parse_args(argv)
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "replica.log"
        serve_args = ["--model", args.model, "--device", args.device,
                      "--max-total-tokens", str(KV_TOKENS)]
        proc = None
        try:
            proc, url = start_replica(serve_args, log)
            server_checks(checks, url, args.device)
        except SystemExit as exc:  # start_replica's way of saying it never got healthy
            checks.failures.append(f"replica: {exc}")
            print(f"FAIL replica start: {exc}", flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
            print("--- replica log (tail) ---\n" + "\n".join(
                log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else "",
                flush=True)
    step_checks(checks, args.device, args.model, args.steps)
    for failure in checks.failures:
        print("FAIL:", failure)
    print("RESULT:", "FAIL" if checks.failures else "PASS", flush=True)
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
