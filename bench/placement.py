"""What a stage placement costs and buys: one replica with every stage in one process (form ①),
one process per stage (form ②), and ① with the vocoder in two processes of its own.

For each form: `omni-dp serve` on a free loopback port (tiny, CPU, one torch thread per process:
the machine this was written on has 2 cores, and ② already runs 4 processes on them), /health
200, a warm-up, then at each concurrency a fixed number of streamed PCM requests (texts and seeds
fixed per request, as engine_throughput.py sends them): requests/s, p50/p99 latency, time to the
first audio chunk, and CPU seconds per request summed over every process that /get_server_info
lists (and split by process). Eight seeded non-streamed requests are hashed in every form; the
audio must be byte-identical across the forms. Each server is stopped with SIGTERM and waited
for, and every process it listed must be gone. The forms run in rounds (one, split, vocoders2,
one, ...) and each point reports the round with the most requests/s, every round's kept: on a
shared 2-core machine other load moves single runs by tens of percent.

    .venv/bin/python bench/placement.py                      # forms one,split,vocoders2; 1,2,4,8
    .venv/bin/python bench/placement.py --quick --json       # concurrency 1,2; 6 requests

Prints a markdown table (or JSON with --json). Exit 0 when every form started, served without
errors, gave the same audio and left nothing running; 1 otherwise; 130 when interrupted (SIGTERM
or ^C: the server in progress is stopped first). With bench/ on sys.path, `placement.main(argv)`
returns that code instead of exiting (e.g. `main(["--quick"])` from a test, ~40 s here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import psutil
from engine_throughput import TEXTS, cpu_seconds, drive, start_replica
from launch_scaling import Interrupted, _raise_interrupted

FORMS = {
    "one": [],
    "split": ["--preprocess.process", "pre", "--talker.process", "talker",
              "--vocoder.process", "vocoder"],
    "vocoders2": ["--vocoder.process", "voc", "--vocoder.replicas", "2"],
}
LABELS = {"one": "① one process", "split": "② process per stage",
          "vocoders2": "① + 2 vocoder processes"}
STOP_TIMEOUT_S = 60
GONE_TIMEOUT_S = 10


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def audio_digests(url: str) -> list[str]:
    """sha256 of the PCM of one non-streamed request per text, each with its fixed seed."""
    digests = []
    for i, text in enumerate(TEXTS):
        body = {"input": text, "seed": i, "response_format": "pcm", "stream": False}
        request = urllib.request.Request(url + "/v1/audio/speech", json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            digests.append(hashlib.sha256(resp.read()).hexdigest()[:16])
    return digests


def handles(processes: list[dict]) -> dict[str, psutil.Process]:
    """role → process, taken once (a psutil.Process keeps its create time: a reused pid is
    not mistaken for ours later)."""
    return {p["role"]: psutil.Process(p["pid"]) for p in processes}


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cpu_by_role(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {role: cpu_seconds(p) for role, p in procs.items()}


def stop(proc: subprocess.Popen, procs: dict[str, psutil.Process], row: dict) -> None:
    """SIGTERM, wait for the exit, then every listed process must be gone (a few seconds of
    grace for stage processes that exit after the main one). The server's children that it did
    not list (or all of them, when it never answered /get_server_info) are checked as well."""
    with contextlib.suppress(psutil.Error):
        listed = {p.pid for p in procs.values()}
        for child in psutil.Process(proc.pid).children(recursive=True):
            if child.pid not in listed:
                procs = {**procs, f"unlisted child {child.pid}": child}
    started = time.perf_counter()
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        row["stop_rc"] = proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        row["stop_rc"] = None
        row["problems"].append(f"not exited {STOP_TIMEOUT_S} s after SIGTERM")
        proc.kill()
        proc.wait()
    row["stop_s"] = round(time.perf_counter() - started, 2)
    if row["stop_rc"] not in (0, None):
        row["problems"].append(f"exit {row['stop_rc']} after SIGTERM")
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while time.monotonic() < deadline and any(alive(p) for p in procs.values()):
        time.sleep(0.1)
    row["left"] = [f"{role} (pid {p.pid})" for role, p in procs.items() if alive(p)]
    if row["left"]:
        row["problems"].append(f"left running: {', '.join(row['left'])}")
        for p in procs.values():  # ours: do not leave them to the next form
            with contextlib.suppress(psutil.Error):
                p.kill()


def run_form(name: str, round_: int, args: argparse.Namespace, tmp: Path) -> dict:
    """One server of one form: start, measure every level, stop, check nothing is left."""
    serve_args = [*shlex.split(args.serve_args), *FORMS[name]]
    row: dict = {"form": name, "round": round_, "serve_args": serve_args, "problems": [],
                 "levels": []}
    print(f"--- {name} (round {round_}): omni-dp serve {' '.join(serve_args)}",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        proc, url = start_replica(serve_args, tmp / f"{name}-{round_}.log")
    except SystemExit as exc:  # start_replica's way to say it did not come up
        row["problems"].append(f"did not start: {str(exc.code)[-2000:]}")
        return row
    procs: dict[str, psutil.Process] = {}
    try:
        row["up_s"] = round(time.perf_counter() - started, 2)
        info = get_json(url + "/get_server_info")
        row["processes"] = info["processes"]
        row["dtype"], row["threads"] = info["dtype"], info["threads"]
        procs = handles(info["processes"])
        asyncio.run(drive(url, 2, args.warmup))  # not reported
        row["digests"] = audio_digests(url)
        client = psutil.Process()
        for level in args.concurrency:
            before, client_before = cpu_by_role(procs), cpu_seconds(client)
            result = asyncio.run(drive(url, level, args.requests))
            after = cpu_by_role(procs)
            done = max(result.requests, 1)
            by_role = {r: round((after[r] - before[r]) / done * 1000, 1) for r in procs}
            result.replica_cpu_ms_per_req = round(
                (sum(after.values()) - sum(before.values())) / done * 1000, 1)
            result.client_cpu_ms_per_req = round(
                (cpu_seconds(client) - client_before) / done * 1000, 1)
            row["levels"].append({**asdict(result), "cpu_ms_per_req_by_process": by_role})
            if result.errors:
                row["problems"].append(f"{result.errors} failed requests at concurrency {level}")
            print(f"{name} concurrency {level}: {result.requests_per_s} req/s, p50 "
                  f"{result.latency_p50_ms} ms", file=sys.stderr, flush=True)
    except Interrupted:
        raise
    except Exception as exc:  # a failed form is a row of its own; the server still stops
        row["problems"].append(f"{type(exc).__name__}: {exc}")
    finally:
        stop(proc, procs, row)
    return row


def check_audio(runs: list[dict]) -> dict:
    """Every run's digests against the first run's (every round of every form)."""
    have = [r for r in runs if "digests" in r]
    forms = sorted({r["form"] for r in have}, key=list(FORMS).index)
    if len(have) < 2:
        return {"identical": None, "compared": forms}
    reference = have[0]["digests"]
    differing = sorted({r["form"] for r in have[1:] if r["digests"] != reference})
    return {"identical": not differing, "compared": forms, "servers": len(have),
            "differing": differing, "requests": len(reference)}


def combine(runs: list[dict], forms: list[str]) -> list[dict]:
    """One row per form: at each level the round with the most requests/s, i.e. the one least
    disturbed by whatever else the machine ran meanwhile (every round's req/s kept)."""
    rows = []
    for form in forms:
        mine = [r for r in runs if r["form"] == form]
        levels = []
        for level in {lv["concurrency"]: None for r in mine for lv in r["levels"]}:
            candidates = [lv for r in mine if (lv := level_of(r, level))]
            best = max(candidates, key=lambda lv: lv["requests_per_s"])
            levels.append({**best, "requests_per_s_rounds":
                           [lv["requests_per_s"] for lv in candidates]})
        processes = next((r["processes"] for r in mine if "processes" in r), [])
        rows.append({"form": form, "processes": processes, "levels": levels})
    return rows


def level_of(row: dict, concurrency: int) -> dict | None:
    return next((lv for lv in row["levels"] if lv["concurrency"] == concurrency), None)


def boundary_cost(rows: list[dict]) -> dict | None:
    """② − ① at concurrency 1: what the process boundaries add to one request on its own."""
    by_form = {r["form"]: r for r in rows}
    if "one" not in by_form or "split" not in by_form:
        return None
    one, split = level_of(by_form["one"], 1), level_of(by_form["split"], 1)
    if not one or not split:
        return None
    keys = ("latency_p50_ms", "ttfa_p50_ms", "replica_cpu_ms_per_req")
    return {k: round(split[k] - one[k], 1) for k in keys}


def one_line(text: str, limit: int = 300) -> str:
    """A problem as a table cell: whitespace collapsed, `|` escaped, the tail kept."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else "…" + text[-limit:]


def markdown(rows: list[dict], runs: list[dict], audio: dict, header: dict) -> str:
    lines = [
        f"### {header['date']} — {header['machine']}",
        "",
        f"`omni-dp serve {header['serve_args']}` + the form's placement options · "
        f"{header['requests']} streamed requests per point after {header['warmup']} warm-up · "
        f"{header['rounds']} round(s) of the forms, interleaved; each point is the round with "
        f"the most req/s · load average before/after: {header['load_before']} / "
        f"{header['load_after']}",
        "",
        "| form | processes | conc. | req/s | req/s by round | p50 ms | p99 ms | TTFA p50 ms "
        "| TTFA p99 ms | CPU ms/req (all processes) | CPU ms/req by process | errors |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        count = len(r.get("processes", [])) or "-"
        for lv in r["levels"]:
            split = " / ".join(f"{role} {ms:g}"
                               for role, ms in lv["cpu_ms_per_req_by_process"].items())
            lines.append(
                f"| {LABELS[r['form']]} | {count} | {lv['concurrency']} | "
                f"{lv['requests_per_s']} | "
                f"{', '.join(map(str, lv['requests_per_s_rounds']))} | "
                f"{lv['latency_p50_ms']} | {lv['latency_p99_ms']} | "
                f"{lv['ttfa_p50_ms']} | {lv['ttfa_p99_ms']} | {lv['replica_cpu_ms_per_req']} | "
                f"{split} | {lv['errors']} |")
        if not r["levels"]:
            lines.append(f"| {LABELS[r['form']]} | {count} |" + " - |" * 10)
    lines += ["", "| form | round | up s | stop s | exit after SIGTERM | left running | problems |",
              "|---|---:|---:|---:|---:|---|---|"]
    for r in runs:
        lines.append(f"| {LABELS[r['form']]} | {r['round']} | {r.get('up_s', '-')} | "
                     f"{r.get('stop_s', '-')} | "
                     f"{r.get('stop_rc', '-')} | {', '.join(r.get('left', [])) or 'nothing'} | "
                     f"{one_line('; '.join(r['problems'])) or '-'} |")
    identical = {True: "identical", False: f"DIFFERENT in {audio.get('differing')}",
                 None: "not compared (fewer than two forms ran)"}[audio["identical"]]
    lines += ["", f"Audio of {audio.get('requests', len(TEXTS))} seeded requests across "
              f"{', '.join(audio['compared']) or 'no form'} ({audio.get('servers', 0)} "
              f"servers): {identical}."]
    cost = header.get("boundary_cost")
    if cost:
        lines.append(f"Process boundaries at concurrency 1 (② − ①): p50 latency "
                     f"{cost['latency_p50_ms']:+} ms, TTFA p50 {cost['ttfa_p50_ms']:+} ms, "
                     f"CPU {cost['replica_cpu_ms_per_req']:+} ms per request.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="one,split,vocoders2",
                        help=f"comma-separated, in order: {', '.join(FORMS)}")
    parser.add_argument("--concurrency", default=None, help="comma-separated levels "
                        "[default: 1,2,4,8; --quick: 1,2]")
    parser.add_argument("--requests", type=int, default=None,
                        help="streamed requests per point [default: 16; --quick: 6]")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up requests per form [default: 8; --quick: 2]")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times the forms are run, interleaved [default: 3; --quick: 1]")
    parser.add_argument("--quick", action="store_true",
                        help="concurrency 1,2; 6 requests; one round")
    parser.add_argument("--serve-args", default="--model tiny --device cpu --threads 1",
                        help="flags for `omni-dp serve` before the form's (the port is "
                        "chosen here)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    args.forms = args.forms.split(",")
    if unknown := [f for f in args.forms if f not in FORMS]:
        parser.error(f"unknown forms {unknown}: take {', '.join(FORMS)}")
    levels = args.concurrency or ("1,2" if args.quick else "1,2,4,8")
    try:
        args.concurrency = [int(c) for c in levels.split(",")]
    except ValueError:
        parser.error(f"--concurrency {levels!r} is not comma-separated integers")
    args.requests = args.requests or (6 if args.quick else 16)
    args.warmup = args.warmup or (2 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupted) if on_main_thread else None
    runs: list[dict] = []
    try:  # SIGTERM unwinds like ^C: the form in progress stops its server on the way out
        with tempfile.TemporaryDirectory(prefix="odp-placement-") as tmp:
            for round_ in range(1, args.rounds + 1):
                for name in args.forms:
                    runs.append(run_form(name, round_, args, Path(tmp)))
    except (Interrupted, KeyboardInterrupt) as exc:
        # a server still coming up when the signal came was never handed back: ours, by pid
        left = psutil.Process().children(recursive=True)
        for child in left:
            with contextlib.suppress(psutil.Error):
                child.terminate()
        psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)
        print(f"interrupted ({exc or 'SIGINT'}) after {len(runs)} server(s)", file=sys.stderr)
        return 130
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    rows = combine(runs, args.forms)
    audio = check_audio(runs)
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}, dtype "
                   f"{next((r['dtype'] for r in runs if 'dtype' in r), '?')}",
        "serve_args": args.serve_args, "requests": args.requests, "warmup": args.warmup,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "boundary_cost": boundary_cost(rows),
    }
    ok = all(not r["problems"] for r in runs) and audio["identical"] is not False
    if args.json:
        print(json.dumps({**header, "ok": ok, "audio": audio, "forms": rows, "runs": runs},
                         indent=2))
    else:
        print(markdown(rows, runs, audio, header))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
