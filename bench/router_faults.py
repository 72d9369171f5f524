"""Replica faults under load, through `omni-dp router`: kill -9 and SIGSTOP, what clients saw.

Each scenario launches a run as an operator would (`omni-dp launch --detach`: 2 built-in tiny
replicas on the CPU, supervised), drives it with C clients in a loop (each answer checked
byte for byte against the same request answered before any fault), hits the replica with the
most requests in flight E times (kill -9, or SIGSTOP for --stop-s seconds then SIGCONT), waits
after each until it is routable again, then `down`s the run and checks nothing is left.

Per scenario: requests, failed (per 1,000) and how (HTTP status, a cut stream, wrong bytes), the
router's retries / resumes / cut streams, time from the fault to the router's ejection and to
the replica being routable again; for SIGSTOP the longest wait of a request that was on the
stopped replica next to the p99 of the others.

    .venv/bin/python bench/router_faults.py --record bench/results/router_faults.md
    .venv/bin/python bench/router_faults.py --source /tmp/old   # another tree's omni_dp
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from launch_scaling import finish_run, free_port_block, omni_dp

TEXTS = ["Your order has shipped and will arrive on Tuesday.",
         "Turn left at the next intersection, then keep right.",
         "The meeting starts in five minutes in room four.",
         "Thank you for calling; please hold while I connect you."]
SCENARIOS = {  # name: (fault, the request body's format fields)
    "kill-whole": ("kill", {"response_format": "wav", "stream": False}),
    "kill-wav": ("kill", {}),  # the default: streamed wav
    "kill-pcm": ("kill", {"response_format": "pcm"}),
    "kill-sse": ("kill", {"response_format": "pcm", "stream_format": "sse"}),
    "sigstop-pcm": ("stop", {"response_format": "pcm"}),
}
POLL_S = 0.02


@dataclass
class Done:
    """One request as its client saw it."""

    start: float
    end: float
    outcome: str  # ok | http NNN | cut | wrong bytes | timeout | error NAME
    replica: str | None
    longest_gap_s: float  # the longest the client waited for its next byte (or its first)


@dataclass
class Fault:
    replica: str
    at: float
    ejected_s: float | None = None  # fault → the router no longer routes to it
    back_s: float | None = None  # fault → routable again (restarted, or continued)


@dataclass
class Load:
    url: str
    fields: dict
    refs: dict = field(default_factory=dict)  # body key → the audio it must give
    done: list[Done] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def bodies(self) -> list[dict]:
        return [{"input": text, "seed": seed, "max_new_tokens": 150, **self.fields}
                for text in TEXTS for seed in (1, 2)]


def audio_of(body: bytes, sse: bool) -> bytes:
    """The answer's audio: the body, or an SSE stream's decoded deltas plus its end event."""
    if not sse:
        return body
    events = [json.loads(block[6:]) for block in body.decode().split("\n\n") if block.strip()]
    if not events or events[-1].get("type") != "speech.audio.done":
        raise ValueError(f"the stream does not end with its done event: {events[-1:]}")
    deltas = b"".join(base64.b64decode(e["audio"]) for e in events if "audio" in e)
    return deltas + json.dumps(events[-1]).encode()


async def request(session: aiohttp.ClientSession, load: Load, body: dict) -> Done:
    start = last = time.monotonic()
    outcome, replica, gap = "ok", None, 0.0
    try:
        async with session.post(load.url + "/v1/audio/speech", json=body) as resp:
            replica = resp.headers.get("X-Omni-DP-Replica")
            data = bytearray()
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                data += chunk
            if resp.status != 200:
                outcome = f"http {resp.status}"
            elif audio_of(bytes(data), "stream_format" in body) != load.refs.get(
                    json.dumps(body)):
                outcome = "wrong bytes"
    except aiohttp.ClientPayloadError:
        outcome = "cut"
    except ValueError:
        outcome = "cut (SSE error event)"
    except asyncio.TimeoutError:
        outcome = "timeout"
    except aiohttp.ClientError as exc:
        outcome = f"error {type(exc).__name__}"
    end = time.monotonic()
    return Done(start, end, outcome, replica, max(gap, end - last))


async def client(session: aiohttp.ClientSession, load: Load, offset: int) -> None:
    bodies = load.bodies()
    i = offset
    while not load.stop.is_set():
        load.done.append(await request(session, load, bodies[i % len(bodies)]))
        i += 1


async def references(session: aiohttp.ClientSession, load: Load) -> None:
    """Each body's answer before any fault: what every later answer must equal."""
    for body in load.bodies():
        async with session.post(load.url + "/v1/audio/speech", json=body) as resp:
            assert resp.status == 200, await resp.text()
            load.refs[json.dumps(body)] = audio_of(await resp.read(), "stream_format" in body)


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with session.get(url + "/workers") as resp:
        return {w["id"]: w for w in (await resp.json())["workers"]}


def replica_pids(run_id: str, env: dict) -> dict[str, int]:
    status = json.loads(omni_dp("status", run_id, "--json", env=env, timeout=30).stdout)
    return {str(r["index"]): r["pid"] for r in status["replicas"]}


async def wait_for(check, timeout: float) -> float | None:
    """Seconds until `check()` (async) holds, or None if it never did within `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await check():
            return time.monotonic() - started
        await asyncio.sleep(POLL_S)
    return None


async def strike(session, load: Load, args, run_id: str, env: dict, kind: str) -> Fault:
    """One fault on the replica with the most requests in flight; back once it is routable."""
    listed = await workers(session, load.url)
    victim = max(listed, key=lambda rid: listed[rid]["in_flight"])
    pid = replica_pids(run_id, env)[victim]
    fault = Fault(victim, time.monotonic())
    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    try:
        async def ejected() -> bool:
            return not (await workers(session, load.url))[victim]["routable"]

        fault.ejected_s = await wait_for(ejected, args.stop_s if kind == "stop" else 30)
        if kind == "stop":
            await asyncio.sleep(max(0.0, fault.at + args.stop_s - time.monotonic()))
    finally:
        if kind == "stop":
            with contextlib.suppress(ProcessLookupError):  # replaced by the supervisor
                os.kill(pid, signal.SIGCONT)

    async def back() -> bool:
        return (await workers(session, load.url))[victim]["routable"]

    after = await wait_for(back, 90)
    fault.back_s = None if after is None else round(time.monotonic() - fault.at, 2)
    return fault


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's retry, resume, cut and hang counters, by their labels."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    wanted = ("retries_total", "resumes_total", "streams_cut_total", "hangs_total")
    found = {}
    for line in text.splitlines():
        if line.startswith("omni_dp_router_") and any(w in line.split("{")[0] for w in wanted):
            name, value = line.rsplit(" ", 1)
            found[name.removeprefix("omni_dp_router_")] = float(value)
    return found


async def drive(args, run_id: str, env: dict, url: str, scenario: str) -> dict:
    kind, fields = SCENARIOS[scenario]
    load = Load(url, fields)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await references(session, load)
        clients = [asyncio.create_task(client(session, load, i)) for i in range(args.clients)]
        faults = []
        try:
            for _ in range(args.events):
                await asyncio.sleep(args.interval)
                faults.append(await strike(session, load, args, run_id, env, kind))
            await asyncio.sleep(args.interval)
        finally:
            load.stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
        counters = await metrics(session, url)
    return summary(scenario, load.done, faults, counters, kind)


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def summary(scenario: str, done: list[Done], faults: list[Fault], counters: dict,
            kind: str) -> dict:
    failed = [d for d in done if d.outcome != "ok"]
    seen: dict[str, int] = {}
    for d in failed:
        seen[d.outcome] = seen.get(d.outcome, 0) + 1
    row = {"scenario": scenario, "requests": len(done), "failed": len(failed),
           "failed_per_1000": round(1000 * len(failed) / max(len(done), 1), 1),
           "failures_seen": seen, "counters": counters,
           "faults": [f.__dict__ | {"at": None} for f in faults]}
    if kind == "stop":
        # The requests in flight while a replica was stopped and not yet ejected (a request
        # resent elsewhere names the replica that answered it, so all of them), and the rest.
        def during(d: Done, f: Fault) -> bool:
            return d.start < f.at + (f.ejected_s or 0) and d.end > f.at

        hit = [d for d in done if any(during(d, f) for f in faults)]
        others = [d for d in done if d not in hit]
        row["stopped_requests"] = len(hit)
        row["stopped_max_s"] = round(max((d.end - d.start for d in hit), default=0), 2)
        row["stopped_max_gap_s"] = round(max((d.longest_gap_s for d in hit), default=0), 2)
        row["others_p99_s"] = round(percentile([d.end - d.start for d in others], 0.99) or 0, 2)
        row["others_p99_gap_s"] = round(
            percentile([d.longest_gap_s for d in others], 0.99) or 0, 2)
    return row


def run_scenario(args, scenario: str) -> dict:
    env = {**os.environ, "OMNI_DP_STATE_DIR": args.state_dir}
    if args.source:
        env["PYTHONPATH"] = str(Path(args.source).resolve())
    base = free_port_block(3)
    run_id = f"faults-{scenario}-{os.getpid()}"
    launch = omni_dp("launch", "--replicas", "2", "--detach", "--run-id", run_id, "--gpu", "none",
                     "--base-port", str(base), "--router-port", str(base + 2),
                     *args.launch_args.split(), "--", "--model", "tiny",  # the seeded preset
                     env=env, timeout=300)
    row: dict = {"scenario": scenario, "run_id": run_id}
    try:
        if launch.returncode != 0:
            row["error"] = f"launch exit {launch.returncode}: {launch.stderr[-500:]}"
            return row
        url = f"http://127.0.0.1:{base + 2}"
        row.update(asyncio.run(drive(args, run_id, env, url, scenario)))
    finally:
        finish_run(Path(args.state_dir), env, run_id, row, None)
    return row


def markdown(rows: list[dict], args) -> str:
    head = (f"### {time.strftime('%Y-%m-%d %H:%M')} — {os.cpu_count()} CPUs "
            f"({platform.machine()}), Python {platform.python_version()}, "
            f"source {args.source or 'this tree'}\n\n"
            f"2 replicas (`omni-dp launch --gpu none`, tiny), {args.clients} clients, "
            f"{args.events} faults {args.interval:g} s apart"
            + (f", SIGSTOP {args.stop_s:g} s" if "sigstop" in " ".join(args.scenarios) else "")
            + "; every answer checked against the same request answered before any fault.\n\n"
            "| scenario | requests | failed | per 1,000 | what failed | fault → ejected s | "
            "fault → routable s | router counters | on the stopped replica |\n"
            "|---|---:|---:|---:|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        faults = r["faults"]
        ejected = ", ".join("-" if f["ejected_s"] is None else f"{f['ejected_s']:.2f}"
                            for f in faults)
        back = ", ".join("-" if f["back_s"] is None else f"{f['back_s']:.1f}" for f in faults)
        seen = ", ".join(f"{n} {k}" for k, n in r["failures_seen"].items()) or "—"
        counters = ", ".join(f"{k.replace('_total', '')} {v:g}"
                             for k, v in sorted(r["counters"].items()) if v) or "—"
        stopped = ("—" if "stopped_max_s" not in r else
                   f"{r['stopped_requests']} in flight until ejected: longest "
                   f"{r['stopped_max_s']} s, longest wait for a byte {r['stopped_max_gap_s']} s"
                   f" (the others' p99: {r['others_p99_s']} s, {r['others_p99_gap_s']} s)")
        lines.append(f"| {r['scenario']} | {r['requests']} | {r['failed']} | "
                     f"{r['failed_per_1000']} | {seen} | {ejected} | {back} | {counters} | "
                     f"{stopped} |")
    return head + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--events", type=int, default=3, help="faults per scenario")
    parser.add_argument("--interval", type=float, default=15.0,
                        help="seconds of load before each fault (and after the last)")
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a SIGSTOP lasts")
    parser.add_argument("--launch-args", default="", help="more `omni-dp launch` flags")
    parser.add_argument("--source", default=None,
                        help="run another tree's omni_dp (PYTHONPATH), e.g. the commit before")
    parser.add_argument("--state-dir", default=None, help="[default: a new temporary dir]")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--record", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; "
                     f"choose from {', '.join(SCENARIOS)}")
    args.state_dir = args.state_dir or tempfile.mkdtemp(prefix="odp-faults-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for scenario in args.scenarios:
        print(f"--- {scenario}", flush=True)
        row = run_scenario(args, scenario)
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = markdown(rows, args)
    print(table)
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n" + table)
    left = [r for r in rows if r.get("left_behind") or r.get("down_rc")]
    return 1 if left or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
