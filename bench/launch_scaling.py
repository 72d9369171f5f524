"""Per-GPU throughput of N replicas behind the router: DP1 vs DP2/DP3, with and without MPS.

For each configuration: `omni-dp launch --detach` (pinned KV, auto CPU blocks), saturating
streamed load through the router at each concurrency level, the attach report (with --mps), the
run's artifacts copied out, `omni-dp down`, and a check that nothing was left behind.

Built to survive a time-limited device call: every configuration has its own time limit
(`--config-timeout`, and the whole `--budget`), a timeout or a failure is a row of its own, and
each row is written (markdown and JSON lines, flushed) as soon as its configuration ends, so a
killed run still leaves every finished row behind. `--cleanup` tears down whatever a killed run
left in its state directory (the device script's exit trap calls it).

    python bench/launch_scaling.py --configs 1,2mps,3mps,2,3 --serve-args "--model small" \\
        --state-dir /tmp/odp --out results/ --launch-args "--start-timeout 90"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from artifacts import copy_artifacts
from engine_throughput import drive

DOWN_TIMEOUT_S = 90  # down drains (router, replicas) and quits the daemon; never skipped


class Interrupted(Exception):
    """SIGTERM (the device call's `timeout`): unwind so every `finally` tears down its run."""


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def omni_dp(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """One omni-dp command in a process group of its own; a TimeoutExpired is the caller's to
    record. On timeout the whole group is killed: a launch killed alone would leave its engine
    dry run running. What the launch started in sessions of their own is `down`'s to stop."""
    argv = [sys.executable, "-m", "omni_dp", *args]
    with subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=max(timeout, 1.0))
        except BaseException:  # the timeout, or SIGTERM (Interrupted) while waiting
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def free_port_block(n: int) -> int:
    """The first of n consecutive free loopback ports (replicas, then the router after them:
    a router port probed on its own could land inside the replicas' range)."""
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


def parse_config(spec: str) -> tuple[int, bool]:
    """`3mps` → (3, True); `2` → (2, False)."""
    mps = spec.endswith("mps")
    count = spec.removesuffix("mps")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"configuration {spec!r} is not N or Nmps (e.g. 1, 2mps)")
    return int(count), mps


def processes_of(state_dir: Path, pipe_root: Path | None = None) -> list[dict]:
    """Every process started under this state directory: all of a run's processes (launcher,
    supervisor, router, replicas, MPS daemon) inherit OMNI_DP_STATE_DIR from the bench; and
    any process whose MPS pipe directory lies under `pipe_root` (another daemon or client of
    the caller's, e.g. the smoke test's). This process and its ancestors are not counted."""
    from omni_dp.procs import read_environ

    me = psutil.Process()
    exempt = {me.pid, *(parent.pid for parent in me.parents())}
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        if proc.pid in exempt:
            continue
        env = read_environ(proc.pid) or {}
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "")
        if env.get("OMNI_DP_STATE_DIR") == str(state_dir) or (
                pipe_root is not None and Path(pipe).is_relative_to(pipe_root) and pipe):
            found.append({"pid": proc.pid, "name": proc.info["name"]})
    return found


def finish_run(state: Path, env: dict, run_id: str, row: dict, artifacts: Path | None,
               pipe_root: Path | None = None) -> None:
    """Artifacts out (when `artifacts` names where), then down — always, whatever happened
    before; the row says how down ended and what is still running of the state dir."""
    run_dir = state / "runs" / run_id
    if run_dir.is_dir() and artifacts is not None:
        row["artifacts"] = len(copy_artifacts(run_dir, artifacts / run_id))
    try:
        down = omni_dp("down", run_id, "--json", env=env, timeout=DOWN_TIMEOUT_S)
        row["down_rc"] = down.returncode
        row["down"] = (json.loads(down.stdout) if down.stdout.strip().startswith("{")
                       else (down.stdout + down.stderr).strip()[-500:])
    except subprocess.TimeoutExpired:
        row["down_rc"] = None
        row["down"] = f"down did not finish in {DOWN_TIMEOUT_S} s"
    row["left_behind"] = processes_of(state, pipe_root)
    row["run_dir_left"] = run_dir.exists()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state_dir).resolve()
        self.out = Path(args.out).resolve()
        self.artifacts = Path(args.artifacts).resolve() if args.artifacts else self.out / "runs"
        self.pipe_root = Path(args.watch_dir).resolve() if args.watch_dir else None
        self.env = {**os.environ, "OMNI_DP_STATE_DIR": str(self.state)}
        self.started = time.monotonic()
        self.md = self.out / "scaling.md"
        self.jsonl = self.out / "scaling.jsonl"

    # --- output, written as each configuration ends ---------------------------------------
    def write_header(self) -> None:
        a = self.args
        header = (f"## {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
                  f"`{a.serve_args}`, launch `{a.launch_args or '-'}`, KV {a.kv_tokens} tokens, "
                  f"{a.requests} requests per level, configuration limit {a.config_timeout:g} s"
                  "\n\n")
        head = "| config | result | up s | " + " | ".join(
            f"c={c} req/s | c={c} p50 ms | c={c} p99 ms | c={c} errors"
            for c in a.concurrency) + " | mps verify | down |"
        line = "|" + "---|" * (3 + 4 * len(a.concurrency) + 2)
        with self.md.open("a") as f:
            f.write(header + head + "\n" + line + "\n")

    def write_row(self, row: dict) -> None:
        with self.md.open("a") as f:
            f.write(markdown_row(row, self.args.concurrency) + "\n")
            f.flush()
        with self.jsonl.open("a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "status"}) + "\n")
            f.flush()
        print(markdown_row(row, self.args.concurrency), flush=True)

    # --- one configuration ----------------------------------------------------------------
    def left_s(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def run_config(self, spec: str) -> dict:
        replicas, mps = parse_config(spec)
        row: dict = {"config": spec, "replicas": replicas, "mps": mps, "result": "ok"}
        if self.left_s() < self.args.min_config_s:
            row["result"] = f"skipped: {max(self.left_s(), 0):.0f} s of the budget left"
            return row
        limit = min(self.args.config_timeout, self.left_s())
        deadline = time.monotonic() + limit
        base = free_port_block(replicas + 1)
        router = base + replicas
        run_id = f"bench-{spec}-{os.getpid()}"
        row["run_id"] = run_id
        launch = ["launch", "--replicas", str(replicas), "--max-total-tokens",
                  str(self.args.kv_tokens), "--detach", "--run-id", run_id, "--base-port",
                  str(base), "--router-port", str(router), "--gpu", self.args.gpu,
                  *shlex.split(self.args.launch_args)]
        if mps:
            launch.append("--mps")
        print(f"--- {spec}: omni-dp {' '.join(launch)} -- {self.args.serve_args}", flush=True)
        started = time.perf_counter()
        try:
            done = omni_dp(*launch, "--", *shlex.split(self.args.serve_args), env=self.env,
                           timeout=deadline - time.monotonic())
            row["up_s"] = round(time.perf_counter() - started, 1)
            row["launch_rc"] = done.returncode
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
            if done.returncode != 0:
                row["result"] = f"launch exit {done.returncode}"
                row["launch_error"] = done.stderr.strip().splitlines()[-5:]
                return row
            self.measure(row, f"http://127.0.0.1:{router}", deadline)
            if mps:
                verify = omni_dp("verify-mps", run_id, env=self.env,
                                 timeout=min(60, deadline - time.monotonic()))
                row["verify_mps_rc"] = verify.returncode
                print(verify.stdout, verify.stderr, sep="\n", flush=True)
            status = omni_dp("status", run_id, "--json", env=self.env, timeout=30)
            row["status"] = json.loads(status.stdout) if status.stdout.strip() else None
        except subprocess.TimeoutExpired as exc:
            row["result"] = f"timeout ({limit:.0f} s) in: {' '.join(map(str, exc.cmd[3:5]))}"
        finally:
            self.finish(run_id, row)
        return row

    def measure(self, row: dict, url: str, deadline: float) -> None:
        asyncio.run(drive(url, 8, 16))  # warm-up (CUDA kernels, allocator)
        for concurrency in self.args.concurrency:
            left = deadline - time.monotonic()
            try:
                result = asyncio.run(asyncio.wait_for(
                    drive(url, concurrency, self.args.requests), timeout=left))
            except (asyncio.TimeoutError, TimeoutError):
                row["result"] = f"timeout ({self.args.config_timeout:g} s) at c={concurrency}"
                return
            row[f"c{concurrency}"] = result.__dict__

    def finish(self, run_id: str, row: dict) -> None:
        finish_run(self.state, self.env, run_id, row, self.artifacts, self.pipe_root)

    # --- a killed run's leftovers -----------------------------------------------------------
    def cleanup(self) -> int:
        """Copy out and tear down every run left in the state directory; report what is left.
        Exit 0 when nothing of this state directory runs any more."""
        runs = sorted((self.state / "runs").glob("*")) if (self.state / "runs").is_dir() else []
        for run_dir in runs:
            row = {"config": "cleanup", "run_id": run_dir.name}
            self.finish(run_dir.name, row)
            print(json.dumps(row), flush=True)
        left = processes_of(self.state, self.pipe_root)
        print(json.dumps({"cleanup_runs": [r.name for r in runs], "left_behind": left}),
              flush=True)
        return 1 if left else 0


def markdown_row(row: dict, concurrency: list[int]) -> str:
    cells = [row["config"], row["result"], str(row.get("up_s", ""))]
    for c in concurrency:
        r = row.get(f"c{c}")
        cells += ([str(r["requests_per_s"]), str(r["latency_p50_ms"]), str(r["latency_p99_ms"]),
                   str(r["errors"])] if r else ["-", "", "", ""])
    cells.append({None: "-", 0: "PASS"}.get(row.get("verify_mps_rc"), "FAIL"))
    left = row.get("left_behind")
    cells.append("-" if "down_rc" not in row else
                 "clean" if row["down_rc"] == 0 and not left else
                 f"rc {row['down_rc']}, {len(left or [])} left")
    return "| " + " | ".join(cells) + " |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="1,2mps,3mps")
    parser.add_argument("--concurrency", default="32,96",
                        help="levels; above the replicas' --max-running-requests (32) so DP1 "
                             "queues")
    parser.add_argument("--requests", type=int, default=192, help="requests per level")
    parser.add_argument("--kv-tokens", type=int, default=65536)
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--serve-args", default="--model small")
    parser.add_argument("--launch-args", default="",
                        help="more `omni-dp launch` flags, e.g. \"--start-timeout 90 "
                             "--on-mps-fault fail\"")
    parser.add_argument("--state-dir", default=None,
                        help="OMNI_DP_STATE_DIR of the runs [default: a new temporary dir, kept]")
    parser.add_argument("--out", default=".", help="where scaling.md and scaling.jsonl go")
    parser.add_argument("--artifacts", default=None,
                        help="where each run's files are copied before down [default: OUT/runs]")
    parser.add_argument("--config-timeout", type=float, default=150.0,
                        help="seconds one configuration may take before down")
    parser.add_argument("--budget", type=float, default=3600.0,
                        help="seconds for all configurations (down comes on top)")
    parser.add_argument("--min-config-s", type=float, default=20.0,
                        help="skip a configuration with less budget than this left")
    parser.add_argument("--cleanup", action="store_true",
                        help="tear down every run left in --state-dir (after a killed bench)")
    parser.add_argument("--watch-dir", default=None,
                        help="also count as left behind any process whose MPS pipe directory "
                             "is under this one")
    parser.add_argument("--record", default=None, help="append the table to this file too")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.configs = args.configs.split(",")
    for spec in args.configs:
        parse_config(spec)  # a typo fails here, not after an hour of the others
    if args.state_dir is None:
        args.state_dir = tempfile.mkdtemp(prefix="odp-bench-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    bench = Bench(args)
    bench.out.mkdir(parents=True, exist_ok=True)
    print(f"state dir {bench.state}, results in {bench.out}", flush=True)
    if args.cleanup:
        return bench.cleanup()
    bench.write_header()
    rows = []
    try:
        for spec in args.configs:
            row = bench.run_config(spec)
            bench.write_row(row)
            rows.append(row)
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"interrupted ({exc or 'SIGINT'}): the run in progress was torn down", flush=True)
        return 130
    left = processes_of(bench.state, bench.pipe_root)
    print("left behind:", left or "nothing", flush=True)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n" + bench.md.read_text())
    return 0 if all(r["result"] == "ok" for r in rows) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
