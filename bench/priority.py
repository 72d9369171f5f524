"""Priority classes measured: interactive callers beside a bulk flood, with and without classes.

One launched run (the trained voice by default, `--replicas 2`) behind its router; three phases
of `--phase-s` each, one after the other on the same run:

  alone     `--interactive` clients (2), each sending one short sentence every
            `--interactive-every` seconds (2: a voice agent's turn, the caller speaking between;
            at once when the answer took longer), streamed raw PCM; nothing else.
  flood     the same, beside `--bulk` clients (16) each sending a 10-sentence text, streamed;
            no request names a class (every one is `default`: the router's and the replica's
            queues are FIFO, as before classes).
  classes   the same flood, the interactive requests with `X-Omni-DP-Priority: interactive`,
            the bulk ones with `bulk`.

Figures per phase: interactive time to first audio (from sending to the first PCM byte) p50 and
p99, and bulk audio seconds delivered per second of the phase (PCM bytes / 2 / 24000 received
inside the phase, finished answers or not). The interactive clients keep their pace in every
phase, so the bulk figures compare the same interactive work (closed-loop interactive clients
would send 5x more with classes than without, and take the bulk's CPU for it). The goal
(issue 42): interactive p99 in `classes` no more than 1.5x its p99 `alone`, and bulk
throughput in `classes` at least 90% of `flood`'s.
A request that fails is counted and shown, never dropped from the figures silently.

    python bench/priority.py --record bench/results/priority.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from launch_scaling import finish_run, free_port_block, omni_dp

from omni_dp.bench.stats import percentile

RATE = 24000  # raw PCM's rate (docs/contracts.md, "Sample rate")
HEADER = "X-Omni-DP-Priority"
SHORT = ("Thank you very much for your help.", "I would like a cup of coffee.",
         "It is a very nice day today.", "The train leaves at nine in the morning.")
LONG = ("We walked along the river until the sun went down. Please close the window before "
        "you leave the room. My sister lives in a small house near the sea. I am going to the "
        "store. The train leaves at nine in the morning. It is a very nice day today. Thank "
        "you very much for your help. I would like a cup of coffee. The children played in "
        "the garden all afternoon. We will meet again next week.")
PHASES = ("alone", "flood", "classes")


@dataclass
class Phase:
    name: str
    started: float = 0.0
    ended: float = 0.0
    first_audio: list[float] = field(default_factory=list)  # interactive, seconds
    bulk_audio_s: float = 0.0  # bulk audio received inside the phase
    bulk_done: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # "class: what" → count

    def fail(self, cls: str, what: str) -> None:
        key = f"{cls}: {what}"
        self.failed[key] = self.failed.get(key, 0) + 1

    def row(self) -> dict:
        fa = self.first_audio
        wall = self.ended - self.started

        def ttfa(q: float) -> float | None:
            value = percentile(fa, q)
            return None if value is None else round(value, 3)

        return {"phase": self.name, "wall_s": round(wall, 1), "interactive": len(fa),
                "ttfa_p50_s": ttfa(50), "ttfa_p90_s": ttfa(90), "ttfa_p99_s": ttfa(99),
                "bulk": self.bulk_done,
                "bulk_audio_s_per_s": round(self.bulk_audio_s / wall, 3) if wall else None,
                "failed": dict(self.failed)}


async def one(session: aiohttp.ClientSession, url: str, text: str, cls: str | None,
              phase: Phase, on_bytes=None) -> tuple[float | None, int]:
    """(time to the first PCM byte, PCM bytes) of one streamed answer; a failure is counted."""
    headers = {HEADER: cls} if cls else {}
    started = time.monotonic()
    first, size = None, 0
    try:
        async with session.post(url, json={"input": text, "response_format": "pcm"},
                                headers=headers,
                                timeout=aiohttp.ClientTimeout(total=600)) as resp:
            if resp.status != 200:
                phase.fail(cls or "none", f"HTTP {resp.status}")
                await resp.read()
                return None, 0
            async for chunk in resp.content.iter_any():
                if first is None and chunk:
                    first = time.monotonic() - started
                size += len(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        phase.fail(cls or "none", type(exc).__name__)
        return None, 0
    return first, size


async def interactive_client(session, url: str, phase: Phase, stop: asyncio.Event,
                             named: bool, offset: int, every: float) -> None:
    i = offset
    await asyncio.sleep(every * offset / 2)  # the clients' turns spread over the period
    while not stop.is_set():
        sent = time.monotonic()
        first, _ = await one(session, url, SHORT[i % len(SHORT)],
                             "interactive" if named else None, phase)
        if first is not None and not stop.is_set():
            phase.first_audio.append(first)
        i += 1
        await asyncio.sleep(max(0.0, sent + every - time.monotonic()))


async def bulk_client(session, url: str, phase: Phase, stop: asyncio.Event,
                      named: bool) -> None:
    def received(n: int) -> None:
        if not stop.is_set():
            phase.bulk_audio_s += n / 2 / RATE

    while not stop.is_set():
        first, _ = await one(session, url, LONG, "bulk" if named else None, phase, received)
        if first is not None and not stop.is_set():  # finished inside the phase
            phase.bulk_done += 1


async def run_phase(url: str, name: str, args: argparse.Namespace, say) -> Phase:
    phase = Phase(name)
    stop = asyncio.Event()
    named = name == "classes"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(interactive_client(session, url, phase, stop, named, i,
                                                        args.interactive_every))
                 for i in range(args.interactive)]
        if name != "alone":
            tasks += [asyncio.create_task(bulk_client(session, url, phase, stop, named))
                      for _ in range(args.bulk)]
        phase.started = time.monotonic()
        await asyncio.sleep(args.phase_s)
        stop.set()
        phase.ended = time.monotonic()
        say(f"{name}: stopping its clients (the answers in flight are not counted)")
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
    return phase


def markdown(rows: list[dict], args: argparse.Namespace, launch: list[str]) -> str:
    by = {r["phase"]: r for r in rows}
    lines = [f"### {time.strftime('%Y-%m-%d %H:%M')} — {args.replicas} replicas, "
             f"{args.interactive} interactive clients (one sentence every "
             f"{args.interactive_every:g} s) + {args.bulk} bulk clients, "
             f"{args.phase_s:g} s per phase", "",
             f"`bench/priority.py {' '.join(args.argv)}` on {os.cpu_count()} CPUs "
             f"({platform.machine()}), Python {platform.python_version()}; launch "
             f"`{' '.join(launch)}`.", "",
             "| phase | interactive answers | time to first audio p50 / p90 / p99 s | "
             "bulk finished | bulk audio s per s | failed |", "|---|---:|---|---:|---:|---|"]
    for r in rows:
        failed = ", ".join(f"{k} ×{v}" for k, v in r["failed"].items()) or "none"
        lines.append(f"| {r['phase']} | {r['interactive']} | {r['ttfa_p50_s']} / "
                     f"{r.get('ttfa_p90_s')} / {r['ttfa_p99_s']} | {r['bulk']} | "
                     f"{r['bulk_audio_s_per_s']} | "
                     f"{failed} |")
    alone, flood, classes = (by.get(p) for p in PHASES)
    if alone and flood and classes and alone["ttfa_p99_s"] and classes["ttfa_p99_s"] \
            and flood["bulk_audio_s_per_s"]:
        ratio = classes["ttfa_p99_s"] / alone["ttfa_p99_s"]
        share = classes["bulk_audio_s_per_s"] / flood["bulk_audio_s_per_s"]
        lines += ["", f"Interactive p99 with the flood and classes: {ratio:.2f}x its p99 alone "
                      f"(goal ≤ 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); without "
                      f"classes {flood['ttfa_p99_s'] / alone['ttfa_p99_s']:.2f}x. Bulk "
                      f"throughput with classes: {share:.0%} of the flood's without "
                      f"(goal ≥ 90%: {'met' if share >= 0.9 else 'NOT met'})."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="replicas [default: 2]")
    p.add_argument("--interactive", type=int, default=2,
                   help="interactive clients [default: 2]")
    p.add_argument("--interactive-every", type=float, default=2.0,
                   help="seconds between one interactive client's requests (at once when "
                        "its answer took longer) [default: 2]")
    p.add_argument("--bulk", type=int, default=16, help="bulk clients [default: 16]")
    p.add_argument("--phase-s", type=float, default=120.0,
                   help="seconds per phase [default: 120]")
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="seconds between phases, for the replicas to finish what the last "
                        "phase's clients left [default: 20]")
    p.add_argument("--engine-args", default="--model joe --voice.process voice",
                   help="the engine's arguments [default: the trained voice]")
    p.add_argument("--launch-args", default="", help="more `omni-dp launch` flags")
    p.add_argument("--record", default=None, help="append the markdown to this file")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("replicas", "interactive", "bulk"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.phase_s <= 0:
        p.error("--phase-s must be positive")
    if args.interactive_every < 0:
        p.error("--interactive-every must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {line}", file=sys.stderr, flush=True)

    scratch = Path(tempfile.mkdtemp(prefix="odp-priority-"))
    state = scratch / "state"
    env = {**os.environ, "OMNI_DP_STATE_DIR": str(state), "TMPDIR": str(scratch)}
    run_id = f"priority-{os.getpid()}"
    base = free_port_block(args.replicas + 1)
    url = f"http://127.0.0.1:{base + args.replicas}/v1/audio/speech"
    launch = ["--replicas", str(args.replicas), "--gpu", "none", "--cpu-blocks", "none",
              "--base-port", str(base), "--router-port", str(base + args.replicas),
              *args.launch_args.split()]
    rows: list[dict] = []
    row: dict = {}
    try:
        say(f"omni-dp launch {' '.join(launch)} -- {args.engine_args}")
        done = omni_dp("launch", "--detach", "--run-id", run_id, *launch, "--",
                       *args.engine_args.split(), env=env, timeout=600)
        if done.returncode != 0:
            say(f"launch failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
            return 1
        for i, name in enumerate(PHASES):
            if i:  # what the last phase's clients left running ends first (cancelled answers)
                say(f"settling {args.settle_s:g} s")
                time.sleep(args.settle_s)
            say(f"{name}: {args.phase_s:g} s")
            phase = asyncio.run(run_phase(url, name, args, say))
            rows.append(phase.row())
            say(f"{name}: {json.dumps(rows[-1])}")
    finally:
        finish_run(state, env, run_id, row, None)
        if row.get("down_rc") == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            say(f"down: {row.get('down')}; kept {scratch}")
    text = markdown(rows, args, launch)
    if args.record:
        with open(args.record, "a") as out:
            out.write("\n" + text)
    print(json.dumps(rows, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
