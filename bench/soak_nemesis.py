"""The soak's nemesis (bench/soak.py): faults on a schedule drawn from a seeded random.Random.

`FAULTS` is the one table of fault kinds. Each kind is a small class whose `strike` does the
fault and returns what, beyond the run being whole again (soak_run.RunView.problems), says it
is over (e.g. the killed replica runs as a new process). An event is one fault, or an overlap:
a second fault struck while the first is still going on (`OVERLAPS`). After each event the
nemesis waits until the run is whole again, and times it from each fault's own start.

The schedule: first every overlap of `overlaps` once and every kind none of them covers (the
coverage round, in a seeded order, always run whole), then, while the duration lasts, one
event after another (an overlap with probability P_OVERLAP), a seeded gap before each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil
from launch_scaling import omni_dp
from soak_run import alive, supervising

OVERLAPS = (("rolling-restart", "replica-kill"), ("supervisor-kill", "stage-kill"),
            ("scale", "router-kill"), ("model-update", "replica-stop"))
P_OVERLAP = 1 / 3
POLL_S = 0.5


@dataclass
class Fault:
    number: int  # its event's
    kind: str
    at: float  # seconds since the soak started
    target: str = ""
    action_s: float | None = None  # the fault's own time: a command's, a stop's, a revival's
    whole_s: float | None = None  # its start → the run whole again (None: not within bound)
    rc: int | None = None  # a day-two command's exit status
    detail: str = ""
    problems: list[str] = field(default_factory=list)  # what was not whole at the bound
    overlap: str | None = None  # the other kind of its event, when an overlap


@dataclass
class Event:
    number: int
    kinds: tuple[str, ...]
    gap: float  # seconds of plain load before it
    delay: float  # an overlap's second fault: seconds after the first began


def events(seed: int, kinds: list[str], overlaps: list[tuple[str, str]], gap: tuple[float, float],
           delay: tuple[float, float]):
    """The schedule, endless: the coverage round, then seeded events."""
    rng = random.Random(seed)
    covered = {k for pair in overlaps for k in pair}
    coverage = [tuple(pair) for pair in overlaps] + [(k,) for k in kinds if k not in covered]
    rng.shuffle(coverage)
    number = 0
    while True:
        if number < len(coverage):
            chosen = coverage[number]
        elif overlaps and rng.random() < P_OVERLAP:
            chosen = tuple(rng.choice(overlaps))
        else:
            chosen = (rng.choice(kinds),)
        yield Event(number, chosen, round(rng.uniform(*gap), 2), round(rng.uniform(*delay), 2))
        number += 1


def coverage_size(kinds: list[str], overlaps: list[tuple[str, str]]) -> int:
    covered = {k for pair in overlaps for k in pair}
    return len(overlaps) + len([k for k in kinds if k not in covered])


class Ctx:
    """What the faults act on: the run, the commands' environment, the targets' randomness."""

    def __init__(self, soak, rng: random.Random) -> None:
        self.soak = soak  # soak.Soak: view, env, run_id, args, shape, say
        self.rng = rng
        self.stopped: set[int] = set()  # SIGSTOPped pids, continued whatever happens

    @property
    def view(self):
        return self.soak.view

    def replica(self) -> tuple[int, int]:
        """A replica drawn from those serving now (healthy in run.json and alive), so that a
        fault during a change hits one the change is not already replacing; with its pid
        (-1 when none serves)."""
        record = self.view.record()
        serving = sorted(r["index"] for r in record.get("replicas", [])
                         if r.get("state") == "healthy" and alive(r))
        if not serving:
            return -1, -1
        index = self.rng.choice(serving)
        return index, self.view.replica_pids().get(index, -1)

    async def command(self, fault: Fault, begun: asyncio.Event, *argv: str) -> int:
        """An omni-dp command on the run; `begun` is set once the supervisor took a day-two
        change's first step (or the command ended)."""
        started = time.monotonic()
        events = self.view.directory / "events.jsonl"
        watch = asyncio.create_task(self.first_step(events, events.stat().st_size, begun))
        try:
            done = await asyncio.to_thread(omni_dp, argv[0], self.soak.run_id, "--json",
                                           *argv[1:], env=self.soak.env,
                                           timeout=self.soak.args.whole_bound)
        finally:
            watch.cancel()
            begun.set()
        fault.action_s = round((fault.action_s or 0) + time.monotonic() - started, 2)
        try:
            outcome = json.loads(done.stdout)
            error = outcome.get("error") or ""
        except ValueError:
            error = (done.stderr or done.stdout).strip()[-300:]
        if done.returncode:
            fault.detail += f"{' '.join(argv)}: exit {done.returncode} {error} ".strip() + "; "
        fault.rc = done.returncode if not fault.rc else fault.rc
        return done.returncode

    @staticmethod
    async def first_step(events, offset: int, begun: asyncio.Event) -> None:
        while not begun.is_set():
            with open(events, "rb") as f:
                f.seek(offset)
                if b'"change_step"' in f.read():
                    begun.set()
            await asyncio.sleep(0.1)


def _kill(pid: int, sig: int) -> None:
    if pid <= 1:  # no such process found: never -1 (every process) or init
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class ReplicaKill:
    kind = "replica-kill"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        index, pid = ctx.replica()
        if pid <= 1:
            fault.detail = "no replica serving to kill"
            return None
        fault.target = f"replica {index} pid {pid}"
        _kill(pid, signal.SIGKILL)
        return lambda: [] if ctx.view.replica_pids().get(index) not in (None, pid) else [
            f"replica {index} not running as a new process"]


class ReplicaStop:
    kind = "replica-stop"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        index, pid = ctx.replica()
        if pid <= 1:
            fault.detail = "no replica serving to stop"
            return None
        fault.target = f"replica {index} pid {pid}, {ctx.soak.args.stop_s:g} s"
        ctx.stopped.add(pid)
        try:
            _kill(pid, signal.SIGSTOP)
            begun.set()
            await asyncio.sleep(ctx.soak.args.stop_s)
        finally:
            _kill(pid, signal.SIGCONT)  # gone, or restarted meanwhile: nothing to continue
            ctx.stopped.discard(pid)
        fault.action_s = ctx.soak.args.stop_s
        return None


class StageKill:
    kind = "stage-kill"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        index, _ = ctx.replica()
        stages = ctx.view.stage_pids(index)
        if not stages:
            fault.detail = f"replica {index} has no stage process"
            return None
        pid = ctx.rng.choice(stages)
        fault.target = f"replica {index} stage pid {pid}"
        _kill(pid, signal.SIGKILL)
        return lambda: [] if ctx.view.stage_pids(index) and pid not in ctx.view.stage_pids(
            index) else [f"replica {index}'s stage processes not replaced"]


class RollingRestart:
    kind = "rolling-restart"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        fault.target = "every replica"
        await ctx.command(fault, begun, "restart")
        return None


class ModelUpdate:
    kind = "model-update"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        soak = ctx.soak
        soak.updated = not soak.updated  # each update flips between the two argument lists
        args = soak.update_args if soak.updated else soak.engine_args
        fault.target = " ".join(args)
        await ctx.command(fault, begun, "restart", "--", *args)
        return None


class Scale:
    kind = "scale"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        n = len(ctx.soak.shape)
        fault.target = f"{n} → {n + 1} → {n}"
        if await ctx.command(fault, begun, "scale", "--replicas", str(n + 1)) == 0:
            await asyncio.sleep(1.0)  # a moment of load on the added replica
        await ctx.command(fault, begun, "scale", "--replicas", str(n))
        return None


class RouterKill:
    kind = "router-kill"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        router = ctx.view.record().get("router") or {}
        pid = router.get("pid", -1)
        victim = pid
        with contextlib.suppress(psutil.Error):
            workers = [c.pid for c in psutil.Process(pid).children()
                       if "spawn_main" in " ".join(c.cmdline())]
            if workers:  # --router-workers K > 1: one worker, not the parent
                victim = ctx.rng.choice(workers)
        fault.target = f"router pid {pid}" + (f", worker pid {victim}" if victim != pid else "")
        _kill(victim, signal.SIGKILL)

        def over() -> list[str]:
            now = (ctx.view.record().get("router") or {}).get("pid")
            gone = (victim != pid and not psutil.pid_exists(victim)) or now != pid
            return [] if gone else ["the router still runs as before"]
        return over


class SupervisorKill:
    kind = "supervisor-kill"

    async def strike(self, ctx: Ctx, fault: Fault, begun: asyncio.Event):
        """kill -9 of the supervisor; serving goes on; after --supervisor-down-s, `omni-dp
        supervise` (a command since 619af1c; before it, the soak started the supervisor's
        entry point itself with the run's id and token in its environment)."""
        soak = ctx.soak
        pid = (ctx.view.record().get("supervisor") or {}).get("pid", -1)
        fault.target = f"supervisor pid {pid}, down {soak.args.supervisor_down_s:g} s"
        _kill(pid, signal.SIGKILL)
        begun.set()
        started = time.monotonic()
        await asyncio.sleep(soak.args.supervisor_down_s)
        if soak.args.sabotage == "router-stays-dead":  # checking the checks: none comes back
            router = (ctx.view.record().get("router") or {}).get("pid", -1)
            _kill(router, signal.SIGKILL)
            fault.detail = f"sabotage: router pid {router} killed, no supervisor started"
            return None
        await ctx.command(fault, asyncio.Event(), "supervise")
        fault.action_s = round(time.monotonic() - started, 2)
        new = (ctx.view.record().get("supervisor") or {}).get("pid", -1)
        fault.detail += f"omni-dp supervise: pid {new}"
        return lambda: [] if supervising(ctx.view.directory, new) else [
            f"the new supervisor {new} is not supervising"]


FAULTS = {cls.kind: cls for cls in (ReplicaKill, ReplicaStop, StageKill, RollingRestart,
                                    Scale, ModelUpdate, RouterKill, SupervisorKill)}


class Nemesis:
    def __init__(self, soak, session) -> None:
        self.soak = soak
        self.session = session
        args = soak.args
        self.ctx = Ctx(soak, random.Random(args.seed + 1))
        self.events = events(args.seed, args.faults, args.overlaps, args.gap, args.delay)
        self.coverage = coverage_size(args.faults, args.overlaps)
        self.faults: list[Fault] = []
        self.stopped_early: str | None = None

    async def run(self, until: float) -> None:
        """Events until the duration is spent (the coverage round always whole)."""
        now = self.soak.load.now
        for event in self.events:
            if event.number >= self.coverage and now() + event.gap >= until:
                return
            await asyncio.sleep(event.gap)
            if not await self.event(event):
                self.stopped_early = (f"event {event.number}: the run was not whole within "
                                      f"{self.soak.args.whole_bound:g} s; no more faults")
                self.soak.say(self.stopped_early)
                return

    async def event(self, event: Event) -> bool:
        """One fault, or two: the second struck `delay` s after the first has begun (a
        command: once the supervisor took its first step)."""
        faults, tasks, begun = [], [], []
        for i, kind in enumerate(event.kinds):
            if i:
                await begun[0].wait()
                await asyncio.sleep(event.delay)
            fault = Fault(event.number, kind, round(self.soak.load.now(), 2),
                          overlap=event.kinds[1 - i] if len(event.kinds) > 1 else None)
            faults.append(fault)
            begun.append(asyncio.Event())
            tasks.append(asyncio.create_task(self.strike(fault, begun[-1])))
            self.soak.say(f"fault {event.number}{'.' + str(i) if i else ''}: {kind} "
                          f"{'(overlapping ' + event.kinds[0] + ') ' if i else ''}started")
        checks = [c for c in await asyncio.gather(*tasks) if c is not None]
        self.faults += faults
        for fault in faults:
            self.soak.say(f"fault {event.number}: {fault.kind} {fault.target} "
                          f"{fault.detail}".rstrip())
        return await self.whole(faults, checks)

    async def strike(self, fault: Fault, begun: asyncio.Event):
        try:
            return await FAULTS[fault.kind]().strike(self.ctx, fault, begun)
        except subprocess.TimeoutExpired as exc:  # the command was killed (its group)
            fault.rc = 124
            fault.detail += f"{' '.join(map(str, exc.cmd[3:5]))}: no end within {exc.timeout:g} s"
        except Exception as exc:  # the fault itself failed: said, counted as a failed command
            fault.rc = -1
            fault.detail += f"the fault failed: {exc!r}"[:300]
        finally:
            begun.set()  # a kill has begun once struck
        return None

    async def whole(self, faults: list[Fault], checks: list) -> bool:
        deadline = min(f.at for f in faults) + self.soak.args.whole_bound
        problems = ["not checked"]
        while self.soak.load.now() < deadline:
            problems = await self.soak.view.problems(self.session, self.soak.shape)
            problems += [p for check in checks for p in await asyncio.to_thread(check)]
            if not problems:
                break
            await asyncio.sleep(POLL_S)
        now = self.soak.load.now()
        for fault in faults:
            if problems:
                fault.problems = problems
            else:
                fault.whole_s = round(now - fault.at, 2)
        self.soak.say(f"event {faults[0].number}: " + (
            f"whole again {faults[0].whole_s:.1f} s after it began" if not problems else
            f"NOT whole within the bound: {'; '.join(problems)[:400]}"))
        return not problems

    def release(self) -> None:
        """Continue every process this nemesis stopped (on any exit)."""
        for pid in list(self.ctx.stopped):
            _kill(pid, signal.SIGCONT)
        self.ctx.stopped.clear()
