"""kill -9 of a vLLM replica under load, with vLLM's own benchmark client, migration on and off.

For each mode a run is launched as an operator would (`omni-dp launch --engine vllm --detach`:
2 replicas of vLLM's CPU build serving the tiny Llama, supervised; `--migration-limit 1` for
"on", nothing for "off", the router's default), then `vllm bench serve` (its serve.py, run by
vLLM's interpreter: the `vllm` console script of the CPU build cannot find its version) sends
N streamed completions (random prompts of the seeded dataset, `--ignore-eos`, greedy) with C at
a time through the router, and the API server of the replica with the most requests in flight
is killed with SIGKILL K seconds in. Each round waits for the supervisor to bring it back. A
first round without a kill is the reference: every request's text in a kill round is compared
with the same request's there.

Per mode: requests, failed (per 1,000, vLLM's client's own count), output tokens received
against N × output-len, texts equal to the uncut ones, the router's migrations and cut streams.

    OMNI_DP_VLLM_PYTHON=... OMNI_DP_TINY_LLAMA=... .venv/bin/python bench/migration_faults.py \\
        --record bench/results/migration.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from launch_scaling import finish_run, free_port_block, omni_dp

CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
          "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
MODES = {"off": (), "on": ("--migration-limit", "1")}


def get_json(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as resp:
        return json.loads(resp.read())


def router_counters(url: str) -> dict[str, float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = ("migrations_total", "streams_cut_total", "retries_total")
    found = {}
    for line in text.splitlines():
        if line.startswith("omni_dp_router_") and any(w in line.split("{")[0] for w in wanted):
            name, value = line.rsplit(" ", 1)
            found[name.removeprefix("omni_dp_router_")] = float(value)
    return found


def client(args, url: str, out: Path, name: str) -> subprocess.Popen:
    """vLLM's benchmark client, saving every request's outcome and text to out/name."""
    argv = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", args.model, "--tokenizer", args.model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--temperature", str(args.temperature), "--seed", "1",
            "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", name, "--ready-check-timeout-sec", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def in_flight(url: str) -> dict[str, int]:
    return {w["id"]: w["in_flight"] for w in get_json(url + "/workers")["workers"]}


def strike(url: str, run_id: str, env: dict, after_s: float, proc: subprocess.Popen) -> dict:
    """`after_s` seconds into the load (from the first request the router sees in flight),
    kill -9 of the API server of the replica with the most requests in flight."""
    while not any(in_flight(url).values()):  # vLLM's client takes a while to import
        if proc.poll() is not None:
            raise RuntimeError("the client ended before any request was in flight")
        time.sleep(0.05)
    time.sleep(after_s)
    workers = in_flight(url)
    victim = max(workers, key=lambda rid: workers[rid])
    status = json.loads(omni_dp("status", run_id, "--json", env=env, timeout=30).stdout)
    pid = {str(r["index"]): r["pid"] for r in status["replicas"]}[victim]
    os.kill(pid, signal.SIGKILL)
    return {"replica": victim, "in_flight": workers[victim], "at": time.time()}


def wait_routable(url: str, replica: str, timeout: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        workers = {w["id"]: w for w in get_json(url + "/workers")["workers"]}
        if workers[replica]["routable"] and workers[replica]["health"] == "healthy":
            return time.monotonic() - started
        time.sleep(1.0)
    return None


def one_round(args, url: str, out: Path, name: str, run_id: str, env: dict,
              kill: bool) -> dict:
    proc = client(args, url, out, name)
    fault = None
    try:
        if kill:
            fault = strike(url, run_id, env, args.kill_after, proc)
        proc.wait(timeout=args.round_timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = json.loads((out / name).read_text())
    if fault is not None:
        fault["back_s"] = wait_routable(url, fault["replica"], args.restart_timeout)
    return {"result": result, "fault": fault}


def compare(result: dict, reference: dict | None, args) -> dict:
    errors = [e for e in result["errors"] if e]
    row = {"requests": args.prompts, "completed": result["completed"],
           "failed": result["failed"], "output_tokens": result["total_output_tokens"],
           "expected_tokens": args.prompts * args.output_len,
           "short": sum(1 for n in result["output_lens"] if n != args.output_len),
           "errors": sorted({e.strip().splitlines()[-1][:120] for e in errors})}
    if reference is not None and not args.temperature:  # sampled texts differ uncut too
        row["texts_equal"] = sum(a == b for a, b in zip(
            result["generated_texts"], reference["generated_texts"], strict=True))
    return row


def run_mode(args, mode: str, reference: dict | None) -> tuple[dict, dict | None]:
    env = {**os.environ, "OMNI_DP_STATE_DIR": args.state_dir}
    base = free_port_block(3)
    run_id = f"migration-{mode}-{os.getpid()}"
    url = f"http://127.0.0.1:{base + 2}"
    out = Path(args.out) / mode
    out.mkdir(parents=True, exist_ok=True)
    launch = omni_dp("launch", "--engine", "vllm", "--engine-python", args.vllm_python,
                     "--replicas", "2", "--max-total-tokens", "2048", "--detach",
                     "--run-id", run_id, "--base-port", str(base), "--router-port",
                     str(base + 2), "--start-timeout", "500", *MODES[mode], "--",
                     args.model, "--enforce-eager", "--dtype", "float32",
                     env=env, timeout=900)
    row: dict = {"mode": mode, "run_id": run_id, "rounds": []}
    try:
        if launch.returncode != 0:
            row["error"] = f"launch exit {launch.returncode}: {launch.stderr[-800:]}"
            return row, reference
        if reference is None:
            reference = one_round(args, url, out, "reference.json", run_id, env,
                                  kill=False)["result"]
            row["reference"] = compare(reference, None, args)
        for i in range(args.rounds):
            done = one_round(args, url, out, f"round{i}.json", run_id, env, kill=True)
            row["rounds"].append({**compare(done["result"], reference, args),
                                  "fault": done["fault"]})
            print(mode, json.dumps(row["rounds"][-1]), flush=True)
        row["counters"] = router_counters(url)
    finally:
        finish_run(Path(args.state_dir), env, run_id, row, None)
    return row, reference


def markdown(rows: list[dict], args) -> str:
    head = (f"### {time.strftime('%Y-%m-%d %H:%M')} — {os.cpu_count()} CPUs "
            f"({platform.machine()}), Python {platform.python_version()}\n\n"
            f"`bench/migration_faults.py`: 2 vLLM CPU replicas of the tiny Llama "
            f"(`omni-dp launch --engine vllm`), `vllm bench serve` with {args.prompts} streamed "
            f"completions a round ({args.input_len} random prompt tokens, {args.output_len} "
            f"output tokens, `--ignore-eos`, "
            + ("greedy" if not args.temperature else f"temperature {args.temperature:g}")
            + f"), {args.concurrency} at a time; kill -9 of "
            f"the busier replica's API server {args.kill_after:g} s into each round's load, "
            f"{args.rounds} rounds a mode.\n\n"
            "| migration | requests | failed | per 1,000 | output tokens received / expected "
            "| texts equal to uncut | replica back after s | router counters |\n"
            "|---|---:|---:|---:|---|---:|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} |  |  |  |  |  |  |")
            continue
        rounds = r["rounds"]
        requests = sum(x["requests"] for x in rounds)
        failed = sum(x["failed"] for x in rounds)
        tokens = sum(x["output_tokens"] for x in rounds)
        expected = sum(x["expected_tokens"] for x in rounds)
        equal = (f"{sum(x['texts_equal'] for x in rounds)} of {requests}"
                 if all("texts_equal" in x for x in rounds) else "— (sampled)")
        back = ", ".join("-" if x["fault"]["back_s"] is None else f"{x['fault']['back_s']:.0f}"
                         for x in rounds)
        counters = ", ".join(f"{k.replace('_total', '')} {v:g}"
                             for k, v in sorted(r.get("counters", {}).items()) if v) or "—"
        lines.append(f"| {r['mode']} | {requests} | {failed} | "
                     f"{1000 * failed / max(requests, 1):.1f} | {tokens} / {expected} | "
                     f"{equal} | {back} | {counters} |")
    return head + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kill-after", type=float, default=8.0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, every text comparable with the uncut round's")
    parser.add_argument("--round-timeout", type=float, default=600.0)
    parser.add_argument("--restart-timeout", type=float, default=400.0)
    parser.add_argument("--vllm-python", default=os.environ.get("OMNI_DP_VLLM_PYTHON"))
    parser.add_argument("--model", default=os.environ.get("OMNI_DP_TINY_LLAMA"))
    parser.add_argument("--state-dir", default=None, help="[default: a new temporary dir]")
    parser.add_argument("--out", default=None, help="the client's results [default: temp]")
    parser.add_argument("--record", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not (args.vllm_python and args.model):
        parser.error("give --vllm-python and --model (or OMNI_DP_VLLM_PYTHON, "
                     "OMNI_DP_TINY_LLAMA)")
    args.model = str(Path(args.model).resolve())
    args.state_dir = args.state_dir or tempfile.mkdtemp(prefix="odp-migration-")
    args.out = args.out or tempfile.mkdtemp(prefix="odp-migration-out-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, reference = [], None
    for mode in args.modes.split(","):
        print(f"--- migration {mode}", flush=True)
        row, reference = run_mode(args, mode, reference)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        rows.append(row)
    table = markdown(rows, args)
    print(table)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n" + table)
    with open(Path(args.out) / "rows.json", "w") as f:
        json.dump(rows, f, indent=1)
    left = [r for r in rows if r.get("left_behind") or r.get("down_rc")]
    return 1 if left or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
