"""Per-GPU throughput of N replicas behind the router: DP1 vs DP2/DP3, with and without MPS.

For each configuration: `omni-dp launch --detach` (pinned KV, auto CPU blocks), saturating
streamed load through the router, the attach report (with --mps), `omni-dp down`, and a check that
nothing was left behind. Prints a markdown table; `--record FILE` appends it.

    python bench/launch_scaling.py --configs 1,2mps,3mps,2,3 --serve-args "--model small"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_throughput import drive

SAMPLE_RATE = 24000


def omni_dp(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def free_port_block(n: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_config(spec: str, args, env: dict) -> dict:
    replicas = int(spec.rstrip("mps"))
    mps = spec.endswith("mps")
    base, router = free_port_block(replicas), free_port_block(1)
    run_id = f"bench-{spec}-{os.getpid()}"
    launch = ["launch", "--replicas", str(replicas), "--max-total-tokens", str(args.kv_tokens),
              "--detach", "--run-id", run_id, "--base-port", str(base),
              "--router-port", str(router), "--gpu", args.gpu]
    if mps:
        launch.append("--mps")
    started = time.perf_counter()
    done = omni_dp(*launch, "--", *args.serve_args.split(), env=env)
    up_s = time.perf_counter() - started
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n", flush=True)
    row = {"config": spec, "replicas": replicas, "mps": mps, "launch_rc": done.returncode,
           "up_s": round(up_s, 1)}
    if done.returncode != 0:
        return row
    try:
        url = f"http://127.0.0.1:{router}"
        asyncio.run(drive(url, 8, 16, SAMPLE_RATE))  # warm-up
        for concurrency in args.concurrency:
            result = asyncio.run(drive(url, concurrency, args.requests, SAMPLE_RATE))
            row[f"c{concurrency}"] = result.__dict__
        if mps:
            verify = omni_dp("verify-mps", run_id, env=env, timeout=60)
            row["verify_mps_rc"] = verify.returncode
            print(verify.stdout, flush=True)
        status = omni_dp("status", run_id, "--json", env=env, timeout=60)
        row["status"] = json.loads(status.stdout) if status.stdout.strip() else None
    finally:
        down = omni_dp("down", run_id, "--json", env=env, timeout=300)
        row["down"] = json.loads(down.stdout) if down.stdout.strip() else down.stderr
    return row


def markdown(rows: list[dict], concurrency: list[int]) -> str:
    head = "| config | up s | " + " | ".join(
        f"c={c} req/s | c={c} p50 ms | c={c} p99 ms" for c in concurrency) + " | mps verify |"
    lines = [head, "|" + "---|" * (2 + 3 * len(concurrency) + 1)]
    for row in rows:
        cells = [row["config"], str(row["up_s"])]
        for c in concurrency:
            r = row.get(f"c{c}")
            cells += ([str(r["requests_per_s"]), str(r["latency_p50_ms"]),
                       str(r["latency_p99_ms"])] if r else ["launch failed", "", ""])
        cells.append({None: "-", 0: "PASS"}.get(row.get("verify_mps_rc"), "FAIL"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="1,2mps,3mps")
    parser.add_argument("--concurrency", default="32")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--kv-tokens", type=int, default=65536)
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--serve-args", default="--model small")
    parser.add_argument("--record", default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="odp") as state:
        env = {**os.environ, "OMNI_DP_STATE_DIR": state}
        rows = [run_config(spec, args, env) for spec in args.configs.split(",")]
        leftovers = list(Path(state, "runs").glob("*")) if Path(state, "runs").exists() else []
    table = markdown(rows, args.concurrency)
    header = (f"\n## {time.strftime('%Y-%m-%d')} — {platform.node()}, {args.serve_args}, KV "
              f"{args.kv_tokens} tokens, {args.requests} requests per level\n\n")
    print(header + table)
    print("left behind:", [p.name for p in leftovers] or "nothing")
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "status"}))
    if args.record:
        with open(args.record, "a") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
