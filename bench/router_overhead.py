"""Router overhead: what one hop through `omni-dp router` costs, next to direct and Rust gateways.

Starts two trivial aiohttp backends on 127.0.0.1 (bench/router_targets.py), then the
targets: direct (one backend), `omni-dp router --workers 1`, `--workers 2`, optionally
`--workers 1` with `--log-level info` (the per-request route line on), a bare aiohttp relay (the
floor an aiohttp hop cannot go under), and the Rust gateways sglang-router 0.3.2 and smg 1.13,
each from a throwaway venv that is never a project dependency:

    python3 -m venv /tmp/sgl-venv && /tmp/sgl-venv/bin/pip install sglang-router==0.3.2
    python3 -m venv /tmp/smg-venv && /tmp/smg-venv/bin/pip install smg==1.13.0

(`--print-setup` prints these; `--sglang-python` / `--smg` point elsewhere). Drives every
target with the same load, interleaved (target order rotated per scenario and repetition, so
background load on a shared machine hits all alike), for a fixed duration per run:

    json c=1 / c=32     POST /generate answered with ~200 bytes of JSON at once
    sse  c=1 / c=32     20 SSE `data:` events + `data: [DONE]`, unpaced
    paced-ttfb c=1      the same events 5 ms apart; a Python client timestamps the first body byte

and reports req/s, p50/p99 latency, CPU ms per request of the hop's process tree (for "direct":
the backend itself) and streamed time to first byte. Everything started is stopped by pid.

    .venv/bin/python bench/router_overhead.py --record bench/results/router.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import aiohttp
from router_report import LABELS, SCENARIOS, RunResult, Scenario, goals, markdown, record, summarise
from router_targets import (
    BODIES,
    Processes,
    Target,
    cpu_seconds,
    measure_ttfb,
    ms,
    run_python_loadgen,
    run_wrk,
    sched_cpu_seconds,
    sglang_version,
    smg_version,
    start_backend,
    start_omni,
    start_relay,
    start_sglang,
    start_smg,
)

SETUP = """python3 -m venv /tmp/sgl-venv && /tmp/sgl-venv/bin/pip install sglang-router==0.3.2
python3 -m venv /tmp/smg-venv && /tmp/smg-venv/bin/pip install smg==1.13.0"""


def run_one(target: Target, scenario: Scenario, rep: int, args, tmp: Path) -> RunResult:
    if scenario.name == "paced-ttfb":
        before = sched_cpu_seconds(target.procs)
        started = time.perf_counter()
        ttfbs, totals = asyncio.run(measure_ttfb(target.url, args.ttfb_requests))
        wall = time.perf_counter() - started
        done = len(ttfbs) + 3
        cpu = sched_cpu_seconds(target.procs) - before
        return RunResult(
            scenario.name, 1, target.name, rep, len(ttfbs), 0, round(done / wall, 1),
            round(statistics.median(totals) * 1000, 2), round(ms(totals, 99), 2),
            round(cpu / done * 1000, 3),
            ttfb_ms=round(statistics.median(ttfbs) * 1000, 2),
            stream_ms=round(statistics.median(totals) * 1000, 1),
        )
    body = BODIES[scenario.name]
    before = cpu_seconds(target.procs)
    if args.loadgen == "wrk":
        out = run_wrk(target.url, scenario.concurrency, args.duration, body, tmp)
    else:
        out = run_python_loadgen(target.url, scenario.concurrency, args.duration, body)
    cpu = cpu_seconds(target.procs) - before
    done = max(out["requests"], 1)
    return RunResult(
        scenario.name, scenario.concurrency, target.name, rep, out["requests"], out["errors"],
        round(out["requests_per_s"], 1), round(out["p50_ms"], 3), round(out["p99_ms"], 3),
        round(cpu / done * 1000, 3),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--ttfb-requests", type=int, default=20,
                        help="paced requests per TTFB measurement (after 3 warm-up)")
    parser.add_argument("--targets", default="direct,omni-w1,omni-w2,relay,sglang,smg",
                        help="comma-separated subset of: " + ", ".join(LABELS))
    parser.add_argument("--scenarios", default=",".join(s.key.replace(" c=", ":")
                                                        for s in SCENARIOS),
                        help="comma-separated NAME:CONCURRENCY (json, sse, paced-ttfb)")
    parser.add_argument("--sglang-python", default="/tmp/sgl-venv/bin/python",
                        help="python of a throwaway venv holding sglang-router (not a project "
                             "dependency)")
    parser.add_argument("--smg", default="/tmp/smg-venv/bin/smg",
                        help="the smg executable of a throwaway venv (not a project dependency)")
    parser.add_argument("--print-setup", action="store_true",
                        help="print the commands that make the gateways' throwaway venvs, and exit")
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto",
                        help="auto: wrk when on PATH, else an aiohttp client in its own process")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--record", type=Path, help="write the results into this markdown file")
    args = parser.parse_args(argv)
    if args.print_setup:
        print(SETUP)
        raise SystemExit(0)
    if args.loadgen == "auto":
        args.loadgen = "wrk" if shutil.which("wrk") else "python"
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(args.targets) - set(LABELS))
    if unknown:
        parser.error(f"unknown target(s): {', '.join(unknown)}")
    scenarios = []
    for item in args.scenarios.split(","):
        name, _, conc = item.strip().partition(":")
        if name not in ("json", "sse", "paced-ttfb"):
            parser.error(f"unknown scenario {item!r}")
        scenarios.append(Scenario(name, int(conc or 1)))
    args.scenarios = scenarios
    return args


def start_targets(procs: Processes, args: argparse.Namespace,
                  skipped: dict[str, str]) -> list[Target]:
    """The two backends, then each target in front of them; one that cannot start is said in
    `skipped` (sglang-router without its venv)."""
    urls, backend_procs = zip(*(start_backend(procs, i) for i in range(2)), strict=True)
    targets: list[Target] = []
    for name in args.targets:
        if name == "direct":
            targets.append(Target("direct", urls[0] + "/generate",
                                  "router_targets.py --backend PORT", [backend_procs[0]]))
        elif name.startswith("omni"):
            workers = 2 if name == "omni-w2" else 1
            level = "info" if name.endswith("info") else "warning"
            targets.append(start_omni(procs, name, list(urls), workers, level))
        elif name == "sglang":
            target = _start_sglang(procs, args.sglang_python, list(urls), skipped)
            targets += [target] if target else []
        elif name == "smg":
            target = _start_smg(procs, args.smg, list(urls), skipped)
            targets += [target] if target else []
        elif name == "relay":
            targets.append(start_relay(procs, list(urls)))
    return targets


def _start_smg(procs: Processes, smg: str, urls: list[str],
               skipped: dict[str, str]) -> Target | None:
    return _start_gateway("smg", "smg", smg_version(smg),
                          f"no smg executable at {smg}", lambda: start_smg(procs, smg, urls),
                          skipped)


def _start_sglang(procs: Processes, python: str, urls: list[str],
                  skipped: dict[str, str]) -> Target | None:
    return _start_gateway("sglang", "sglang-router", sglang_version(python),
                          f"no sglang-router importable by {python}",
                          lambda: start_sglang(procs, python, urls), skipped)


def _start_gateway(key: str, name: str, version: str | None, absent: str,
                   start: Callable[[], Target], skipped: dict[str, str]) -> Target | None:
    """A Rust gateway if it is installed and starts; else why not, in `skipped`."""
    if version is None:
        skipped[key] = f"{absent} (--print-setup says how to install it)"
        return None
    try:
        target = start()
    except RuntimeError as exc:
        skipped[key] = f"{name} {version} did not start: {exc}"
        return None
    target.command += f"  ({name} {version})"
    return target


def warm_up(targets: list[Target], args: argparse.Namespace, tmp: Path) -> None:
    """A second of each load per target, not reported."""
    for target in targets:
        for body in (BODIES["json"], BODIES["sse"]):
            if args.loadgen == "wrk":
                run_wrk(target.url, 8, 1, body, tmp)
            else:
                run_python_loadgen(target.url, 8, 1, body)


def run_all(targets: list[Target], args: argparse.Namespace, tmp: Path) -> list[RunResult]:
    """Every (repetition, scenario, target), the target order rotated per scenario and
    repetition so no target always runs first."""
    results = []
    for rep in range(args.repetitions):
        for s_index, scenario in enumerate(args.scenarios):
            shift = (rep + s_index) % len(targets)
            for target in targets[shift:] + targets[:shift]:
                result = run_one(target, scenario, rep, args, tmp)
                results.append(result)
                extra = f" ttfb {result.ttfb_ms} ms" if result.ttfb_ms else ""
                print(f"rep {rep} {scenario.key:<14} {target.name:<13} "
                      f"{result.requests_per_s:>8} req/s p50 {result.p50_ms:.2f} ms "
                      f"cpu {result.cpu_ms_per_req:.3f} ms/req{extra}", file=sys.stderr)
    return results


def header_of(args: argparse.Namespace, targets: list[Target], skipped: dict[str, str]) -> dict:
    """What the numbers were measured with, for the record."""
    wrk_version = ""
    if args.loadgen == "wrk":
        out = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
        wrk_version = (out.stdout or out.stderr).split(" [")[0].strip()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}",
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": _version("uvloop"),
        "loadgen": (f"`{wrk_version}` (`-t1`, keep-alive, `--latency`)" if wrk_version else
                    "Python aiohttp client in a separate process (not wrk)"),
        "duration": args.duration,
        "repetitions": args.repetitions,
        "ttfb_requests": args.ttfb_requests,
        "targets": {t.name: t.command for t in targets},
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        procs = Processes(tmp)
        try:
            targets = start_targets(procs, args, skipped)
            if not targets:
                reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
                raise SystemExit(f"router_overhead.py: no target to measure ({reasons})")
            runs = len(targets) * len(args.scenarios) * args.repetitions
            print(f"{runs} runs, about {runs * (args.duration + 1) / 60:.1f} min "
                  f"(load generator: {args.loadgen})", file=sys.stderr)
            warm_up(targets, args, tmp)
            results = run_all(targets, args, tmp)
        except KeyboardInterrupt:
            print("interrupted: stopping everything", file=sys.stderr)
            raise SystemExit(130) from None
        finally:
            procs.stop_all()
    summary = summarise(results, [t.name for t in targets])
    ordered = {s.key: summary[s.key] for s in args.scenarios if s.key in summary}
    header = header_of(args, targets, skipped)
    goal_lines = goals(ordered)
    if args.json:
        print(json.dumps({**header, "goals": goal_lines,
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(markdown(ordered, header, goal_lines))
    if args.record:
        record(args.record, markdown(ordered, header, goal_lines))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
