"""What tracing costs the router: CPU per request, before the tracing code existed, with it off
(the default), and on (--otlp-traces-endpoint, spans exported to a sink that answers 200).

Two trivial aiohttp backends (router_targets.py --backend) answer ~200 bytes of JSON; three
`omni-dp router --workers 1` processes run in front of them: `before` from a checkout of the
code before tracing (--before DIR, e.g. `git worktree add /tmp/before <commit>`), `off` and
`on` from this tree. A client in its own process drives C requests at a time for D seconds per
run; the router's CPU (its threads' schedstat) over the requests it answered is the figure.
Runs are interleaved (the order rotated each round), R rounds; medians and ranges reported.

    .venv/bin/python bench/tracing_overhead.py --before /tmp/before \
        --record bench/results/tracing.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
from router_targets import (
    BODIES,
    HOST,
    REPO,
    Processes,
    free_port,
    http_get,
    run_python_loadgen,
    sched_cpu_seconds,
    start_backend,
    wait_until,
)

MODES = ("before", "off", "on")


def run_sink(port: int) -> None:
    """An OTLP/HTTP traces endpoint that reads each export and answers 200 (an empty
    ExportTraceServiceResponse is zero bytes of protobuf)."""
    from aiohttp import web

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def start_router(procs: Processes, mode: str, backends: list[str], source: Path,
                 sink: str) -> tuple[str, psutil.Process]:
    port = free_port()
    argv = [sys.executable, "-m", "omni_dp", "router", "--port", str(port), "--policy",
            "round_robin", "--log-level", "warning", "--drain-timeout", "2",
            *(a for url in backends for a in ("--replica", url))]
    if mode == "on":
        argv += ["--otlp-traces-endpoint", sink]
    env = {**os.environ, "PYTHONPATH": str(source)}
    log_path = procs.tmp / f"router-{mode}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, cwd=source, start_new_session=True)
    procs.started.append(proc)
    url = f"http://{HOST}:{port}"
    wait_until(lambda: http_get(url + "/ready")[0] == 200, proc, log_path, f"router {mode}")
    return url + "/generate", psutil.Process(proc.pid)


def measure(url: str, proc: psutil.Process, concurrency: int, duration: float) -> dict:
    before = sched_cpu_seconds([proc])
    result = run_python_loadgen(url, concurrency, duration, BODIES["json"])
    cpu = sched_cpu_seconds([proc]) - before
    ok = result["requests"] - result["errors"]
    return {"requests": ok, "errors": result["errors"],
            "cpu_us_per_request": round(cpu / max(ok, 1) * 1e6, 1),
            "requests_per_s": round(result["requests_per_s"], 1),
            "p50_ms": round(result["p50_ms"], 3)}


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode: the median of its rounds, and the median of its round-by-round difference
    from `before` (the rounds pair runs a few seconds apart: a shared machine's load moves
    both alike)."""
    out = {}
    base = [r["cpu_us_per_request"] for r in runs["before"]]
    for mode, results in runs.items():
        cpu = [r["cpu_us_per_request"] for r in results]
        diffs = sorted(c - b for c, b in zip(cpu, base, strict=True))
        out[mode] = {"cpu_us_median": round(statistics.median(cpu), 1),
                     "vs_before_us": round(statistics.median(diffs), 1),
                     "vs_before_quartiles": (round(diffs[len(diffs) // 4], 1),
                                             round(diffs[(3 * len(diffs)) // 4], 1)),
                     "cpu_us_min": min(cpu), "cpu_us_max": max(cpu),
                     "requests": sum(r["requests"] for r in results),
                     "errors": sum(r["errors"] for r in results),
                     "requests_per_s_median": round(statistics.median(
                         r["requests_per_s"] for r in results), 1)}
    return out


def markdown(header: dict, table: dict[str, dict]) -> str:
    rows = ["| router | CPU per request (median of rounds) | range | minus `before`, same "
            "round (median; quartiles) | requests | errors | req/s (median) |",
            "|---|---|---|---|---|---|---|"]
    for mode, s in table.items():
        low, high = s["vs_before_quartiles"]
        rows.append(f"| {mode} | **{s['cpu_us_median']} µs** | {s['cpu_us_min']}–"
                    f"{s['cpu_us_max']} µs | {s['vs_before_us']:+} µs ({low:+}, {high:+}) | "
                    f"{s['requests']} | {s['errors']} | {s['requests_per_s_median']} |")
    return "\n".join([f"```\n{json.dumps(header, indent=1)}\n```", "", *rows, ""])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True,
                        help="a checkout of the code before tracing (its omni_dp is run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (args.before / "omni_dp" / "router" / "proxy.py").is_file():
        sys.exit(f"tracing_overhead: --before {args.before}: no omni_dp/router/proxy.py there")
    with tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp:
        procs = Processes(Path(tmp))
        try:
            backends = [start_backend(procs, i)[0] for i in range(2)]
            sink_port = free_port()
            sink_proc, sink_log = procs.spawn("sink", [sys.executable, __file__, "--sink",
                                                       str(sink_port)])
            sink = f"http://{HOST}:{sink_port}"
            wait_until(lambda: http_get(sink + "/health")[0] == 200, sink_proc, sink_log, "sink")
            sources = {"before": args.before.resolve(), "off": REPO, "on": REPO}
            routers = {mode: start_router(procs, mode, backends, sources[mode],
                                          sink + "/v1/traces") for mode in MODES}
            for url, proc in routers.values():  # warm-up, not counted
                measure(url, proc, args.concurrency, 1.0)
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for round_ in range(args.rounds):
                order = MODES[round_ % 3:] + MODES[:round_ % 3]
                for mode in order:
                    runs[mode].append(measure(*routers[mode], args.concurrency, args.duration))
                    print(mode, runs[mode][-1], file=sys.stderr, flush=True)
        finally:
            procs.stop_all()
    header = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs), Python "
                         f"{platform.python_version()}",
              "load": f"POST /generate (~200 B JSON answer), {args.concurrency} at a time, "
                      f"{args.duration:g} s per run, {args.rounds} rounds interleaved",
              "before": str(args.before)}
    table = summary(runs)
    print(markdown(header, table))
    if args.record:
        with args.record.open("a") as out:
            out.write(markdown(header, table))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sink"]:
        run_sink(int(sys.argv[2]))
    else:
        main()
