"""A chaos soak: a launched run under mixed load for a duration, faults on a seeded schedule,
invariants checked throughout and reported at the end.

    .venv/bin/python bench/soak.py --record bench/results/soak.md --duration 60m
    .venv/bin/python bench/soak.py --engine seeded --duration 5m --seed 7 --json
    .venv/bin/python bench/soak.py --engine vllm --duration 20m   # needs .venv-vllm, tiny-llama

The run: `omni-dp launch --detach` of N replicas (default 2) on the CPU, each with a stage in a
process of its own (the voice: `--voice.process voice`; seeded: `--vocoder.process vocoder`;
vLLM has its EngineCore), so that a stage process can be killed. The load (soak_load.py):
interactive (short texts, streamed PCM and SSE) and bulk (long texts, WAV whole and
streamed) speech, or streamed and whole completions for vLLM. The nemesis (soak_nemesis.py):
kill -9 of a replica, SIGSTOP then SIGCONT, kill -9 of a stage process, `omni-dp restart`,
`omni-dp scale` up and down, a model update (`omni-dp restart RUN -- <changed args>`), kill -9
of the router (of one worker with --router-workers K > 1; the supervisor restarts a dead
router), kill -9 of the supervisor (serving goes on; `omni-dp supervise` brings supervision
back after --supervisor-down-s), and overlaps of two. After each event the run must be whole
again (soak_run.py says what that means). The invariants (soak_checks.py) are judged at the
end; the report (soak_report.py): requests by outcome, each fault with the time to whole,
the resource curves (PNG), the verdicts. Exit 0 when every invariant holds, 1 otherwise.

Progress goes to stderr (a line per fault, a status line every minute); stdout gets the
markdown, or with --json the summary as JSON. Everything started is stopped at the end — the
run by `omni-dp down`, then anything still carrying the soak's state directory, by pid — also
on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import aiohttp
import soak_checks as checks
from launch_scaling import finish_run, free_port_block, omni_dp, processes_of
from soak_load import OK, UNREACHABLE, Load, asks
from soak_nemesis import FAULTS, OVERLAPS, Nemesis
from soak_report import latency, markdown, plot
from soak_run import RunView, files_left, ports_taken

# engine: (engine args, the model update's, bounds in s: interactive, bulk, whole again). A
# request's bound is the router's --replica-wait (30 s: with no replica to go to, it waits
# for one before it refuses) plus what the class takes on a loaded replica here.
ENGINES = {
    "voice": (["--model", "joe", "--voice.process", "voice"], ["--voice-lookahead", "1"],
              (45.0, 90.0, 180.0)),
    "seeded": (["--model", "tiny", "--vocoder.process", "vocoder"],
               ["--max-running-requests", "16"], (45.0, 90.0, 180.0)),
    "vllm": (["--enforce-eager", "--dtype", "float32"], ["--max-num-seqs", "8"],
             (90.0, 150.0, 600.0)),
}
LIBRARY_FILES = (".ses", "pulse")  # onnxruntime's telemetry file; espeak-ng's libpulse dir


def seconds(text: str) -> float:
    """`90`, `90s`, `5m`, `1.5h` → seconds."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90, 90s, 5m, 1h)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def span(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    return float(low), float(high or low)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.scratch = Path(args.state_dir or tempfile.mkdtemp(prefix="odp-soak-")).resolve()
        self.state, self.tmp = self.scratch / "state", self.scratch / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "OMNI_DP_STATE_DIR": str(self.state), "TMPDIR": str(self.tmp)}
        if args.api_key:
            self.env["OMNI_DP_API_KEY"] = args.api_key
        self.run_id = f"soak-{os.getpid()}"
        self.shape = {str(i) for i in range(args.replicas)}
        self.updated = False
        base, update, _ = ENGINES[args.engine]
        self.engine_args = ([args.vllm_model] if args.engine == "vllm" else []) + base
        self.update_args = self.engine_args + update
        self.base = free_port_block(args.replicas + 2)  # room for one more, then the router
        self.url = f"http://127.0.0.1:{self.base + args.replicas + 1}"
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.view = RunView(self.state / "runs" / self.run_id, self.tmp, self.url, self.headers)
        model = args.vllm_model if args.engine == "vllm" else None
        self.load = Load(self.url, asks(args.engine, model), args.clients, args.bounds,
                         headers=self.headers)
        self.samples: list = []
        self.nemesis: Nemesis | None = None
        self.references: list[str] = []

    def say(self, line: str) -> None:
        t = time.monotonic() - self.t0
        print(f"[{int(t // 60):3d}:{int(t % 60):02d}] {line}", file=sys.stderr, flush=True)

    def launch_args(self) -> list[str]:
        a = self.args
        argv = ["--replicas", str(a.replicas), "--gpu", "none", "--cpu-blocks", "none",
                "--base-port", str(self.base), "--router-port", str(self.base + a.replicas + 1),
                "--router-workers", str(a.router_workers), "--drain-timeout", "15",
                "--restart-budget", "20"]
        if a.engine == "vllm":
            argv += ["--engine", "vllm", "--engine-python", a.vllm_python,
                     "--max-total-tokens", "1024", "--migration-limit", "1"]
        return argv + a.launch_args.split()

    def launch(self) -> str | None:
        argv = ["launch", "--detach", "--run-id", self.run_id, *self.launch_args(), "--",
                *self.engine_args]
        self.say(f"omni-dp {' '.join(argv)}")
        done = omni_dp(*argv, env=self.env, timeout=self.args.whole_bound * 2)
        if done.returncode != 0:
            return f"launch exit {done.returncode}: {done.stderr.strip()[-800:]}"
        self.say(f"launched {self.run_id} behind {self.url}")
        return None

    # --- the soak itself ---------------------------------------------------------------------
    async def drive(self) -> None:
        self.load.t0 = self.t0 = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.nemesis = Nemesis(self, session)
            background = [asyncio.create_task(self.sampler()),
                          asyncio.create_task(self.status_lines())]
            clients: list[asyncio.Task] = []
            try:
                self.references = await self.load.references(session)
                if self.args.sabotage == "wrong-reference":
                    self.sabotage_reference()
                self.say(f"references: {len(self.load.refs)} asks, exact: {self.load.exact()}")
                clients = self.load.start(session)
                await self.nemesis.run(self.args.duration)
                tail = max(self.args.gap[0], self.args.duration - self.load.now())
                if self.nemesis.stopped_early:
                    tail = min(tail, 30.0)
                await asyncio.sleep(tail)  # load after the last fault, a gap at least
            finally:
                self.load.stop.set()
                self.nemesis.release()
                for task in background:
                    task.cancel()
                if clients:
                    longest = max(self.args.bounds.values()) * 2 + 10
                    _, pending = await asyncio.wait(clients, timeout=longest)
                    for task in pending:
                        task.cancel()
                await asyncio.gather(*clients, *background, return_exceptions=True)

    def sabotage_reference(self) -> None:
        """Checking the checks: one reference made wrong (a byte flipped, or where answers
        are not reproducible, a duration three times the real one)."""
        ref = next(iter(self.load.refs.values()))
        if ref.exact:
            ref.payload = ref.payload[:-1] + bytes([ref.payload[-1] ^ 1])
        else:
            ref.measure *= 3

    async def sampler(self) -> None:
        while True:
            self.samples += await asyncio.to_thread(self.view.sample, self.load.now())
            await asyncio.sleep(self.args.sample_every)

    async def status_lines(self) -> None:
        while True:
            await asyncio.sleep(self.args.status_every)
            counts: dict[str, int] = {}
            for d in self.load.done:
                counts[d.outcome] = counts.get(d.outcome, 0) + 1
            latest = {s.role: s for s in self.samples[-12:]}
            rss = ", ".join(f"{role} {s.rss >> 20} MiB" for role, s in sorted(latest.items()))
            faults = self.nemesis.faults if self.nemesis else []
            self.say(f"status: {len(self.load.done)} requests "
                     f"({', '.join(f'{k} {v}' for k, v in counts.items())}); {len(faults)} "
                     f"faults, {sum(f.whole_s is not None for f in faults)} whole again; {rss}")

    # --- the end: down, what is left, the verdicts ---------------------------------------------
    def finish(self) -> dict:
        row: dict = {}
        if self.nemesis is not None:
            self.nemesis.release()
        if (self.state / "runs" / self.run_id).exists():
            finish_run(self.state, self.env, self.run_id, row, self.scratch / "artifacts")
        else:
            row.update(down_rc=0, down="nothing to down", left_behind=processes_of(self.state))
        time.sleep(0.5)  # sockets of processes just gone
        row["ports_taken"] = ports_taken(list(range(self.base, self.base + self.args.replicas
                                                    + 2)))
        row["files_left"] = files_left(self.tmp, LIBRARY_FILES) + [
            f"state/{p}" for p in files_left(self.state / "runs", ())]
        for proc in processes_of(self.state):  # what down could not stop: by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc["pid"], signal.SIGKILL)
        return row

    def cleanup(self, clean: bool) -> None:
        if clean and not self.args.state_dir:
            shutil.rmtree(self.scratch, ignore_errors=True)
        elif not clean:
            self.say(f"kept for diagnosis: {self.scratch}")


def summary(soak: Soak, down: dict, launch_error: str | None) -> dict:
    a, done = soak.args, soak.load.done
    faults = soak.nemesis.faults if soak.nemesis else []
    tolerance = checks.Tolerance()
    roles = ["router", "supervisor", *(f"replica {i}" for i in sorted(soak.shape))]
    spans = checks.quiet(faults, soak.load.now())
    count = max(3, round(a.window / a.sample_every))
    drift = checks.drift(soak.samples, roles, a.warmup, count, tolerance, spans)
    verdicts = [checks.references(soak.references + ([launch_error] if launch_error else [])),
                checks.answers(done, faults, a.whole_bound), checks.bounds(done, a.bounds),
                checks.whole(faults, a.whole_bound), checks.commands(faults),
                checks.coverage(faults, a.faults), checks.flat(drift, tolerance),
                checks.down(down)]
    return {
        "ok": all(v.ok for v in verdicts),
        "run": {"command": " ".join(["bench/soak.py", *a.argv]), "engine": a.engine,
                "replicas": a.replicas, "seed": a.seed, "duration_s": soak.load.now(),
                "started": time.time() - soak.load.now(), "engine_args": soak.engine_args,
                "update_args": soak.update_args, "launch_args": soak.launch_args(),
                "clients": a.clients, "sample_every": a.sample_every, "warmup": a.warmup,
                "count": count, "tolerance": tolerance.describe(), "run_id": soak.run_id},
        "requests": checks.by_outcome(done), "latency": latency(done, a.bounds),
        "not_ok": [{"cls": d.cls, "form": d.form, "start": round(d.start, 1),
                    "took": round(d.end - d.start, 2), "outcome": d.outcome,
                    "status": d.status, "replica": d.replica, "detail": d.detail[:160]}
                   for d in done if d.outcome not in (OK, UNREACHABLE)],
        "exact": soak.load.exact(), "faults": [dataclasses.asdict(f) for f in faults],
        "drift": drift, "verdicts": [dataclasses.asdict(v) for v in verdicts],
        "stopped_early": (soak.nemesis.stopped_early if soak.nemesis else None) or launch_error,
        "down": {k: v for k, v in down.items() if k != "down"},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=list(ENGINES), default="voice",
                   help="voice: the trained voice joe; seeded: the built-in tiny preset "
                        "(deterministic: answers compared byte for byte); vllm: vLLM's CPU "
                        "build serving --vllm-model [default: voice]")
    p.add_argument("--duration", type=seconds, default=seconds("60m"),
                   help="how long the load runs (90s, 5m, 1h); the coverage round of faults "
                        "always runs whole, so a short duration ends after it [default: 60m]")
    p.add_argument("--seed", type=int, default=1,
                   help="the fault schedule's and targets' seed [default: 1]")
    p.add_argument("--replicas", type=int, default=2,
                   help="replicas the run is launched with (its shape) [default: 2]")
    p.add_argument("--clients", default="interactive=2,bulk=1",
                   help="clients per class, each sending one request after another "
                        "[default: interactive=2,bulk=1]")
    p.add_argument("--bounds", default=None,
                   help="the longest a request of each class may take, seconds: the "
                        "router's --replica-wait (30 s) plus the class's own time "
                        "[default: voice, seeded interactive=45,bulk=90; vllm "
                        "interactive=90,bulk=150]")
    p.add_argument("--whole-bound", type=float, default=None,
                   help="seconds a fault's run has to be whole again [default: 180; vllm 600]")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"the fault kinds to use [default: all: {', '.join(FAULTS)}]")
    p.add_argument("--overlaps", default=",".join("+".join(o) for o in OVERLAPS),
                   help="overlaps to use, FIRST+SECOND (the second struck --delay s after the "
                        "first began), or none [default: all: "
                        + ", ".join("+".join(o) for o in OVERLAPS) + "]")
    p.add_argument("--gap", type=span, default=span("20:60"),
                   help="seconds of plain load before each event, MIN:MAX, drawn from the "
                        "seed [default: 20:60]")
    p.add_argument("--delay", type=span, default=span("1:4"),
                   help="an overlap's second fault: seconds after the first began, MIN:MAX "
                        "[default: 1:4]")
    p.add_argument("--stop-s", type=float, default=10.0,
                   help="how long a SIGSTOP lasts [default: 10]")
    p.add_argument("--supervisor-down-s", type=float, default=10.0,
                   help="how long the killed supervisor stays dead before it is revived "
                        "[default: 10]")
    p.add_argument("--router-workers", type=int, default=1,
                   help="the launch's --router-workers (K > 1: router-kill kills one worker) "
                        "[default: 1]")
    p.add_argument("--sample-every", type=float, default=5.0,
                   help="seconds between resource samples (psutil, every process of the run) "
                        "[default: 5]")
    p.add_argument("--warmup", type=seconds, default=None,
                   help="resources are judged after this [default: 10%% of the duration]")
    p.add_argument("--window", type=seconds, default=None,
                   help="resources: the first and the last WINDOW / --sample-every samples "
                        "taken while no fault was going on are compared (medians; 3 at least) "
                        "[default: 10%% of the duration, at least 20 s]")
    p.add_argument("--status-every", type=float, default=60.0, help="seconds between status "
                   "lines [default: 60]")
    p.add_argument("--launch-args", default="",
                   help="more `omni-dp launch` flags, e.g. \"--retries 2\"")
    p.add_argument("--api-key", default=None, help="launch the run with this --api-key")
    p.add_argument("--vllm-python", default=os.environ.get("OMNI_DP_VLLM_PYTHON"),
                   help="vLLM's interpreter [$OMNI_DP_VLLM_PYTHON]")
    p.add_argument("--vllm-model", default=os.environ.get("OMNI_DP_TINY_LLAMA"),
                   help="the model directory vLLM serves [$OMNI_DP_TINY_LLAMA]")
    p.add_argument("--sabotage", choices=["router-stays-dead", "wrong-reference"],
                   default=None, help="check the checks: the supervisor is killed and not "
                   "revived, then the router (nothing brings it back); or one reference "
                   "answer has a byte flipped. The soak must then fail")
    p.add_argument("--state-dir", default=None,
                   help="the run's state and TMPDIR go here (kept) [default: a temporary "
                        "directory, removed when nothing is left in it]")
    p.add_argument("--record", default=None, help="append the markdown to this file; the PNG "
                   "goes beside it")
    p.add_argument("--png", default=None, help="the resource curves' PNG [default: beside "
                   "--record, soak-ENGINE-DURATION.png]")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON on stdout (instead of the markdown)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    interactive, bulk, whole = ENGINES[args.engine][2]
    args.bounds = {"interactive": interactive, "bulk": bulk} | {
        k: float(v) for k, v in (kv.split("=") for kv in (args.bounds or "").split(",") if kv)}
    args.clients = {k: int(v) for k, v in (kv.split("=") for kv in args.clients.split(","))}
    if set(args.clients) - set(args.bounds):
        p.error(f"--clients: classes are {sorted(args.bounds)}")
    args.whole_bound = args.whole_bound or whole
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in args.faults if f not in FAULTS]
    args.overlaps = [] if args.overlaps == "none" else [
        tuple(o.split("+")) for o in args.overlaps.split(",") if o]
    unknown += [k for o in args.overlaps for k in o if k not in FAULTS or len(o) != 2]
    if unknown:
        p.error(f"unknown fault kind(s) {unknown}; the kinds: {', '.join(FAULTS)}")
    args.warmup = args.duration / 10 if args.warmup is None else args.warmup
    args.window = max(20.0, args.duration / 10) if args.window is None else args.window
    if args.engine == "vllm" and not (args.vllm_python and args.vllm_model):
        p.error("--engine vllm needs --vllm-python and --vllm-model (scripts/setup-vllm, "
                "scripts/make-tiny-llama)")
    return args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: every `finally` runs, then down
    soak = Soak(args)
    launch_error = None
    down: dict = {}
    try:
        launch_error = soak.launch()
        if launch_error is None:
            asyncio.run(soak.drive())
    except KeyboardInterrupt as exc:
        soak.say(f"interrupted ({exc or 'SIGINT'}): downing the run")
        launch_error = f"interrupted ({exc or 'SIGINT'})"
    except Exception as exc:  # a fault of the soak's own: still down, still a record
        traceback.print_exc()
        launch_error = f"the soak failed: {exc!r}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the teardown runs to its end
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        down = soak.finish()
    result = summary(soak, down, launch_error)
    png = None
    if soak.samples and (args.png or args.record):
        d = args.duration
        label = f"{d / 60:g}m" if d % 60 == 0 else f"{d:g}s"
        png_path = Path(args.png) if args.png else \
            Path(args.record).parent / f"soak-{args.engine}-{label}.png"
        plot(soak.samples, soak.nemesis.faults if soak.nemesis else [], png_path)
        png = os.path.relpath(png_path, Path(args.record).parent) if args.record else str(
            png_path)
    text = markdown(result, png)
    if args.record:
        with open(args.record, "a") as out:
            out.write("\n" + text)
    print(json.dumps(result, indent=1) if args.json else text, flush=True)
    soak.cleanup(clean=checks.down(down).ok)
    for verdict in result["verdicts"]:
        soak.say(f"{verdict['name']}: {'holds' if verdict['ok'] else 'BROKEN'} — "
                 f"{verdict['detail'][:300]}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
