"""Checks of the CUDA path of one replica; needs an NVIDIA GPU (run through bench/gpu_check.sh).

Starts `omni-dp serve --device cuda`, then checks what CI cannot: the replica reports a CUDA
device for its process, the KV pool is the size asked for, a request is reproducible, streamed
and non-streamed audio match, and a batch of concurrent requests all succeed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import aiohttp
from engine_throughput import start_replica


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/v1/audio/speech", json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.read()


async def concurrent(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            body = {"input": f"Concurrent request {i}.", "seed": i}
            async with session.post(url + "/v1/audio/speech", json=body) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one(i) for i in range(n)))


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "small"
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--model", model, "--device", "cuda", "--max-total-tokens", "65536"]
        proc, url = start_replica(args, Path(tmp) / "replica.log")
        try:
            with urllib.request.urlopen(url + "/get_server_info") as resp:
                info = json.load(resp)
            print(json.dumps({k: info[k] for k in ("device", "dtype", "max_total_num_tokens",
                                                   "kv_cache_bytes", "processes")}))
            if not info["device"].startswith("cuda"):
                failures.append(f"device is {info['device']}")
            if any(not p["device"].startswith("cuda") for p in info["processes"]):
                failures.append("a process does not report its CUDA device")
            if info["max_total_num_tokens"] != 65536:
                failures.append(f"KV tokens {info['max_total_num_tokens']} != 65536")
            body = {"input": "The GPU path, checked.", "seed": 1, "response_format": "pcm"}
            first, second = post(url, body), post(url, body)
            streamed = post(url, {**body, "stream": True})
            if first != second:
                failures.append("the same request alone gave different audio")
            if streamed != first:
                failures.append("streamed audio differs from non-streamed")
            statuses = asyncio.run(concurrent(url, 64))
            if set(statuses) != {200}:
                failures.append(f"concurrent statuses {sorted(set(statuses))}")
        finally:
            proc.terminate()
            proc.wait(60)
    for failure in failures:
        print("FAIL:", failure)
    print("RESULT:", "FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
