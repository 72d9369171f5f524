"""What `--share-weights` saves, measured: N replicas with their own weights against N sharing one
copy, on the CPU (file-backed shared memory) or a GPU (CUDA IPC, under MPS with --mps).

For each of the two runs (`omni-dp launch --detach`, pinned KV, then `omni-dp down` and a check
that nothing was left): the time to ready, every replica's memory — on the CPU USS (what the
process alone holds) and PSS (shared pages split between their users; ΣPSS is what the run
costs the host), on a GPU the device memory in use before and after the run and each process's
own — and the audio of one seeded request sent to every replica directly (byte-identical or
not). The sharing run then loses its leader to kill -9 and the time until every replica is back
through the gates (new pids, healthy, the share re-published) is taken.

    python bench/weight_share.py --serve-args "--model small --dtype float32" \\
        --replicas 3 --out results/
    python bench/weight_share.py --serve-args "--model small" --gpu 0 --mps   # on a GPU

Prints a markdown table (and appends it to --record) and one JSON line per run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from launch_scaling import (
    Interrupted,
    _raise_interrupted,
    finish_run,
    free_port_block,
    omni_dp,
    processes_of,
)

from omni_dp.gpus import nvml_gpu_memory, query_gpu

MiB = 1024**2
SPEECH = {"input": "One copy of the weights for every replica.", "seed": 7,
          "max_new_tokens": 24, "response_format": "pcm"}


def speech_digest(url: str) -> str:
    request = urllib.request.Request(url + "/v1/audio/speech", json.dumps(SPEECH).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return hashlib.sha256(response.read()).hexdigest()[:16]


def host_memory(pids: list[int]) -> dict[int, dict[str, int]]:
    """USS and PSS of each process (psutil reads /proc/PID/smaps_rollup)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(pid).memory_full_info()
            found[pid] = {"uss": info.uss, "pss": info.pss, "rss": info.rss}
    return found


def device_memory(gpu: str) -> tuple[int | None, dict[int, int]]:
    """Used bytes of the GPU and each compute process's own (MPS clients included), as the
    launcher reads them (omni_dp/gpus.py); (None, {}) where NVML cannot say."""
    facts, _, _ = query_gpu(gpu)
    per, _ = nvml_gpu_memory(gpu)
    return (facts.memory_used_bytes if facts else None), per or {}


class ShareBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state_dir).resolve()
        self.out = Path(args.out).resolve()
        self.env = {**os.environ, "OMNI_DP_STATE_DIR": str(self.state)}

    def status(self, run_id: str) -> dict:
        done = omni_dp("status", run_id, "--json", env=self.env, timeout=30)
        return json.loads(done.stdout)

    def run(self, share: bool) -> dict:
        a = self.args
        n = a.replicas
        name = "shared" if share else "separate"
        row: dict = {"run": name, "replicas": n, "result": "ok"}
        base = free_port_block(n + 1)
        run_id = f"share-bench-{name}-{os.getpid()}"
        launch = ["launch", "-n", str(n), "--max-total-tokens", str(a.kv_tokens), "--detach",
                  "--run-id", run_id, "--base-port", str(base), "--router-port", str(base + n),
                  "--gpu", a.gpu, *(["--mps"] if a.mps else []),
                  *(["--share-weights"] if share else []), *shlex.split(a.launch_args)]
        idle_used, _ = device_memory(a.gpu) if a.gpu != "none" else (None, {})
        print(f"--- {name}: omni-dp {' '.join(launch)} -- {a.serve_args}", flush=True)
        started = time.perf_counter()
        try:
            done = omni_dp(*launch, "--", *shlex.split(a.serve_args), env=self.env,
                           timeout=a.run_timeout)
            row["up_s"] = round(time.perf_counter() - started, 1)
            if done.returncode != 0:
                row["result"] = f"launch exit {done.returncode}"
                row["error"] = done.stderr.strip().splitlines()[-5:]
                return row
            self.measure(row, run_id, idle_used)
            if share:
                self.leader_kill(row, run_id)
        except subprocess.TimeoutExpired as exc:
            row["result"] = f"timeout in {' '.join(map(str, exc.cmd[3:5]))}"
        finally:
            self.finish(run_id, row)
        return row

    def measure(self, row: dict, run_id: str, idle_used: int | None) -> None:
        status = self.status(run_id)
        replicas = status["replicas"]
        row["share"] = status.get("share")
        row["digests"] = [speech_digest(f"http://127.0.0.1:{r['port']}") for r in replicas]
        row["identical"] = len(set(row["digests"])) == 1
        time.sleep(1.0)  # let the first request's allocations settle before reading memory
        pids = [r["pid"] for r in replicas]
        memory = host_memory(pids)
        row["host"] = {str(r["index"]): memory[r["pid"]] for r in replicas if r["pid"] in memory}
        row["sum_pss"] = sum(m["pss"] for m in row["host"].values())
        row["sum_uss"] = sum(m["uss"] for m in row["host"].values())
        row["memory_bytes"] = [r.get("memory_bytes") for r in replicas]
        if idle_used is not None:
            used, per = device_memory(self.args.gpu)
            row["device_used_delta"] = used - idle_used if used is not None else None
            row["device_per_process"] = {str(p): per.get(p) for p in pids}

    def leader_kill(self, row: dict, run_id: str) -> None:
        before = self.status(run_id)["replicas"]
        old = {r["pid"] for r in before}
        os.kill(before[0]["pid"], signal.SIGKILL)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.args.recovery_timeout
        while time.monotonic() < deadline:
            after = self.status(run_id)["replicas"]
            if all(r["health"] == "healthy" and r["state"] == "healthy" and r["pid"] not in old
                   for r in after):
                row["leader_kill_recovery_s"] = round(time.perf_counter() - t0, 1)
                row["identical_after"] = len({speech_digest(f"http://127.0.0.1:{r['port']}")
                                              for r in after}) == 1
                return
            time.sleep(0.5)
        row["result"] = f"not recovered {self.args.recovery_timeout:g} s after the leader kill"

    def finish(self, run_id: str, row: dict) -> None:
        artifacts = Path(self.args.artifacts) if self.args.artifacts else None
        finish_run(self.state, self.env, run_id, row, artifacts)


HEADER = ("| run | result | up s | ΣPSS MiB | ΣUSS MiB | per replica USS MiB | shared MiB "
          "| GPU used Δ MiB | per replica GPU MiB | identical audio | leader kill → all back s "
          "| down |\n" + "|" + "---|" * 12)


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER, *(table_row(r) for r in rows)])


def table_row(r: dict) -> str:
    """One run's row, printed as soon as the run ends (a device call cut short keeps it)."""
    host = r.get("host") or {}
    uss = " / ".join(f"{m['uss'] / MiB:.0f}" for m in host.values()) or "-"
    share = r.get("share") or {}
    delta = r.get("device_used_delta")
    down = ("clean" if r.get("down_rc") == 0 and not r.get("left_behind")
            and not r.get("run_dir_left") else f"rc {r.get('down_rc')}, left "
            f"{len(r.get('left_behind') or [])}")
    after = "" if "identical_after" not in r else f" (after: {r['identical_after']})"
    gpu = " / ".join("-" if b is None else f"{b / MiB:.0f}"
                     for b in (r.get("device_per_process") or {}).values()) or "-"
    return (
        f"| {r['run']} | {r['result']} | {r.get('up_s', '-')} | "
        f"{r.get('sum_pss', 0) / MiB:.0f} | {r.get('sum_uss', 0) / MiB:.0f} | {uss} | "
        f"{share.get('shared_bytes', 0) / MiB:.0f} | "
        f"{'-' if delta is None else f'{delta / MiB:.0f}'} | {gpu} | "
        f"{r.get('identical', '-')}{after} | "
        f"{r.get('leader_kill_recovery_s', '-')} | {down} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--serve-args", default="--model small --dtype float32")
    parser.add_argument("--gpu", default="none", help="a GPU index, or none for the CPU")
    parser.add_argument("--mps", action="store_true")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--launch-args", default="--cpu-blocks none",
                        help="more `omni-dp launch` flags")
    parser.add_argument("--run-timeout", type=float, default=240.0,
                        help="seconds one launch may take")
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--out", default=".")
    parser.add_argument("--artifacts", default=None, help="copy each run's files here")
    parser.add_argument("--record", default=None, help="append the table to this file too")
    parser.add_argument("--runs", default="separate,shared",
                        help="which runs, in order: separate, shared")
    args = parser.parse_args(argv)
    args.runs = args.runs.split(",")
    if not set(args.runs) <= {"separate", "shared"}:
        parser.error("--runs takes separate and/or shared")
    if args.state_dir is None:
        args.state_dir = tempfile.mkdtemp(prefix="odp-share-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    bench = ShareBench(args)
    bench.out.mkdir(parents=True, exist_ok=True)
    rows = []
    title = (f"## {time.strftime('%Y-%m-%d %H:%M')} — `{args.serve_args}`, {args.replicas} "
             f"replicas, gpu {args.gpu}{' (MPS)' if args.mps else ''}, KV {args.kv_tokens} "
             "tokens")
    print(f"{title}\n\n{HEADER}", flush=True)
    try:
        for name in args.runs:
            row = bench.run(share=name == "shared")
            print(json.dumps(row), flush=True)
            print(table_row(row), flush=True)
            rows.append(row)
    except (Interrupted, KeyboardInterrupt) as exc:
        left = processes_of(bench.state)
        print(f"interrupted ({exc or 'SIGINT'}): the run in progress was torn down; left "
              f"running: {left or 'nothing'}", flush=True)
        return 130
    text = f"{title}\n\n{table(rows)}\n"
    (bench.out / "weight_share.md").write_text(text)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n" + text)
    ok = all(r["result"] == "ok" and r.get("identical") and r.get("identical_after", True)
             and r.get("down_rc") == 0 and not r.get("left_behind") and not r.get("run_dir_left")
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
