"""Day-two changes under load: what clients see while `omni-dp restart` and `omni-dp scale` change
a live run.

One run, launched as an operator would (`omni-dp launch --detach`: 2 built-in tiny replicas on
the CPU, supervised, room for a third), driven by C clients in a loop, each answer checked byte
for byte against the same request answered before any change (router_faults.py's load). Then,
one after another, with --settle seconds of plain load between them:

1. `omni-dp restart RUN` — rolling, the same arguments;
2. `omni-dp restart RUN -- --model tiny --max-running-requests 16` — a changed engine argument
   list, as a model update is (the same weights, so the answers may still be checked byte for
   byte);
3. `omni-dp scale RUN --replicas 3`, then 4. `--replicas 1`, then 5. `--replicas 2`.

With --rounds R the five run R times. Last, what an operator had to do before these commands:
`omni-dp down` and `omni-dp launch` again with the new arguments (--no-relaunch skips it).

Per change: its exit status, time in all and per replica (the change's own step times), and the
requests that started while it ran: how many, failed (per 1,000) and how. Then the whole run,
the relaunch left out.

    .venv/bin/python bench/day_two.py --record bench/results/day_two.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from launch_scaling import finish_run, free_port_block, omni_dp
from router_faults import Done, Load, client, references

CHANGES = (
    ("restart", ("restart",)),
    ("model update", ("restart", "--", "--model", "tiny", "--max-running-requests", "16")),
    ("scale 2 → 3", ("scale", "--replicas", "3")),
    ("scale 3 → 1", ("scale", "--replicas", "1")),
    ("scale 1 → 2", ("scale", "--replicas", "2")),  # back to two: a next round restarts them
)
FORMATS = {"response_format": "pcm"}  # streamed PCM: a change that cut one would show


class ShortLoad(Load):
    """router_faults.py's load with shorter answers: more requests in the same time."""

    max_new_tokens = 40

    def bodies(self) -> list[dict]:
        return [{**body, "max_new_tokens": self.max_new_tokens} for body in super().bodies()]


def failed(done: list[Done]) -> dict:
    """How many of these failed, per 1,000, and how; the outage: from the first failed request's
    start to the last one's end (clients send again at once, so a refused port fails many)."""
    bad = [d for d in done if d.outcome != "ok"]
    how: dict[str, int] = {}
    for d in bad:
        how[d.outcome] = how.get(d.outcome, 0) + 1
    outage = (max(d.end for d in bad) - min(d.start for d in bad)) if bad else 0.0
    return {"requests": len(done), "failed": len(bad),
            "failed_per_1000": round(1000 * len(bad) / max(len(done), 1), 1), "how": how,
            "outage_s": round(outage, 1)}


async def change(args, run_id: str, env: dict, load: Load, name: str,
                 argv: tuple[str, ...]) -> dict:
    """One change, its command run while the clients keep sending."""
    command, rest = argv[0], argv[1:]
    started = time.monotonic()
    done = await asyncio.to_thread(omni_dp, command, run_id, "--json", *rest, env=env,
                                   timeout=args.change_timeout)
    ended = time.monotonic()
    row: dict = {"change": name, "rc": done.returncode, "seconds": round(ended - started, 1)}
    try:
        outcome = json.loads(done.stdout)
        row["steps"] = [{"action": s["action"], "replica": s["replica"],
                         "seconds": s["seconds"]} for s in outcome.get("steps", [])]
        row["error"] = outcome.get("error")
    except ValueError:
        row["error"] = (done.stderr or done.stdout).strip()[-400:]
    row.update(failed([d for d in load.done if started <= d.start <= ended]))
    print(f"{name}: rc {row['rc']}, {row['seconds']} s, {row['requests']} requests, "
          f"{row['failed']} failed", flush=True)
    return row


async def relaunch(args, run_id: str, env: dict, load: Load, launch: list[str]) -> dict:
    """The way before day-two commands: down, then launch again (a model update's args)."""
    started = time.monotonic()
    down = await asyncio.to_thread(omni_dp, "down", run_id, env=env, timeout=120)
    again = await asyncio.to_thread(omni_dp, *launch, "--max-running-requests", "16", env=env,
                                    timeout=300)
    ended = time.monotonic()
    row = {"change": "before: down + launch", "rc": down.returncode or again.returncode,
           "seconds": round(ended - started, 1), "steps": [],
           "error": None if again.returncode == 0 else again.stderr.strip()[-400:]}
    row.update(failed([d for d in load.done if started <= d.start <= ended]))
    print(f"{row['change']}: rc {row['rc']}, {row['seconds']} s, {row['requests']} requests, "
          f"{row['failed']} failed", flush=True)
    return row


async def drive(args, run_id: str, env: dict, url: str, launch: list[str]) -> dict:
    ShortLoad.max_new_tokens = args.max_new_tokens
    load = ShortLoad(url, FORMATS)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await references(session, load)
        clients = [asyncio.create_task(client(session, load, i)) for i in range(args.clients)]
        rows = []
        try:
            for _ in range(args.rounds):
                for name, argv in CHANGES:
                    await asyncio.sleep(args.settle)
                    rows.append(await change(args, run_id, env, load, name, argv))
            await asyncio.sleep(args.settle)
            whole = failed(list(load.done))
            if args.relaunch:
                rows.append(await relaunch(args, run_id, env, load, launch))
                await asyncio.sleep(args.settle)
        finally:
            load.stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    return {"changes": rows, "whole_run": whole}


def run(args) -> dict:
    env = {**os.environ, "OMNI_DP_STATE_DIR": args.state_dir}
    base = free_port_block(4)  # three replicas at most, then the router
    run_id = f"day-two-{os.getpid()}"
    # unpinned: three replicas on a machine of two cores have no disjoint blocks to pin to
    launch = ["launch", "--replicas", "2", "--detach", "--run-id", run_id, "--gpu", "none",
              "--cpu-blocks", "none", "--base-port", str(base), "--router-port", str(base + 3),
              "--drain-timeout", str(args.drain_timeout), *args.launch_args.split(),
              "--", "--model", "tiny"]
    started = omni_dp(*launch, env=env, timeout=300)
    row: dict = {"run_id": run_id}
    try:
        if started.returncode != 0:
            row["error"] = f"launch exit {started.returncode}: {started.stderr[-500:]}"
            return row
        row.update(asyncio.run(drive(args, run_id, env, f"http://127.0.0.1:{base + 3}",
                                     launch)))
    finally:
        finish_run(Path(args.state_dir), env, run_id, row, None)
    return row


def per_replica(row: dict) -> str:
    return ", ".join(f"{s['action']} {s['replica']} {s['seconds']:.1f}"
                     for s in row.get("steps", [])) or "—"


def markdown(result: dict, args) -> str:
    head = (f"### {time.strftime('%Y-%m-%d %H:%M')} — {os.cpu_count()} CPUs "
            f"({platform.machine()}), Python {platform.python_version()}\n\n"
            f"2 built-in tiny replicas (`omni-dp launch --gpu none --cpu-blocks none`, drain bound "
            f"{args.drain_timeout:g} s), {args.clients} clients streaming PCM "
            f"(`max_new_tokens` {args.max_new_tokens}), "
            f"{args.settle:g} s of load between changes; every answer checked against the "
            "same request answered before any change.\n\n")
    if "error" in result:
        return head + f"launch failed: {result['error']}\n"
    lines = ["| change | exit | time in all s | per replica s | requests meanwhile | failed | "
             "per 1,000 | clients' outage s | what failed |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in result["changes"]:
        how = ", ".join(f"{n} {k}" for k, n in r["how"].items()) or "—"
        lines.append(f"| {r['change']} | {r['rc']} | {r['seconds']} | {per_replica(r)} | "
                     f"{r['requests']} | {r['failed']} | {r['failed_per_1000']} | "
                     f"{r['outage_s']} | {how} |")
    whole = result["whole_run"]
    lines.append(f"| the whole run, the relaunch left out | | | | {whole['requests']} | "
                 f"{whole['failed']} | "
                 f"{whole['failed_per_1000']} | {whole['outage_s']} | "
                 f"{', '.join(f'{n} {k}' for k, n in whole['how'].items()) or '—'} |")
    left = result.get("left_behind")
    tail = f"\nLeft behind after `down`: {left or 'nothing'}.\n"
    return head + "\n".join(lines) + "\n" + tail


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds of load before each change and after the last")
    parser.add_argument("--drain-timeout", type=float, default=15.0,
                        help="the run's --drain-timeout: each replica's drain bound")
    parser.add_argument("--rounds", type=int, default=1, help="times the five changes run")
    parser.add_argument("--max-new-tokens", type=int, default=40,
                        help="each request's length (shorter: more requests)")
    parser.add_argument("--no-relaunch", dest="relaunch", action="store_false",
                        help="leave out the down + launch of before")
    parser.add_argument("--change-timeout", type=float, default=600.0)
    parser.add_argument("--launch-args", default="", help="more `omni-dp launch` flags")
    parser.add_argument("--state-dir", default=None, help="[default: a new temporary dir]")
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    parser.add_argument("--record", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    args.state_dir = args.state_dir or tempfile.mkdtemp(prefix="odp-day-two-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = markdown(result, args)
    print(text)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.record:
        with open(args.record, "a") as out:
            out.write("\n" + text)
    ok = "error" not in result and all(r["rc"] == 0 for r in result["changes"]
                                       if not r["change"].startswith("before"))
    return 0 if ok and not result.get("left_behind") else 1


if __name__ == "__main__":
    sys.exit(main())
