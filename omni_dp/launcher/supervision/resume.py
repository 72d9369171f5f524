"""`omni-dp supervise`: a supervisor again for a live run whose supervisor died (kill -9, OOM).

Serving goes on without one (the router and replicas run on), but nothing restarts a replica
that fails. This starts the detached supervisor as `launch --detach` does (detached.py: the
run's environment contract, the router's key from OMNI_DP_API_KEY) and returns once run.json
names it supervising. It adopts the processes as they are (takeover.py).

Refused, before anything is started: a run whose supervisor is alive (nothing to do: not a
refusal, said), one not live (stopped, torn down, failed, never finished starting), one whose
`launch` still runs (it hands the run to a supervisor itself), and one whose router wants an
API key that is not set here (or that the router refuses). A supervisor that dies or does not
supervise in time is stopped (SIGKILL, by pid and create time: SIGTERM would make it tear the
run down) and said; the run is never torn down here: it goes on serving, unsupervised.

One `supervise` at a time per run: it holds a lock on the run directory from its checks until
its supervisor supervises (a second one waits, then finds it supervised).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from omni_dp.blocking_http import http_json
from omni_dp.contract import API_KEY_ENV
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.detached import (
    SUPERVISOR_HANDOFF_S,
    start_supervisor,
    stop_unsupervising,
    supervising,
)
from omni_dp.procs import is_alive
from omni_dp.runfile import RunFileError, RunPhase, SupervisorRecord, run_is_live

LOCK_WAIT_S = SUPERVISOR_HANDOFF_S + 15.0  # another supervise's start, and its stop


class NotSupervisable(Exception):
    """The run cannot be given a supervisor now; the message says why and what to do.
    Nothing was started."""


class ResumeFailed(Exception):
    """A supervisor was started and is not supervising (it died, or did not in time, or the
    command was interrupted); it is stopped. The run was left as it was."""

    def __init__(self, message: str, resumed: Resumed, interrupted: bool = False) -> None:
        super().__init__(message)
        self.resumed = resumed
        self.interrupted = interrupted


@dataclass
class Resumed:
    """What `supervise` found or did: the run's supervisor now (`supervised`), whether it was
    already there, the one before it."""

    run_id: str
    supervised: bool
    already: bool  # its supervisor was alive: nothing was started
    pid: int | None  # the supervisor (started, or found)
    previous_pid: int | None = None  # the dead one, when one was started
    log: str | None = None
    supervising_since: float | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "supervised": self.supervised, "already": self.already,
                "pid": self.pid, "previous_pid": self.previous_pid, "log": self.log,
                "supervising_since": self.supervising_since, "error": self.error}

    def line(self) -> str:
        if self.already:
            return f"run {self.run_id} is supervised by pid {self.pid}" + (
                "" if self.supervising_since else " (starting: not yet through its first sweep)")
        return (f"supervisor pid {self.pid} is supervising run {self.run_id} again "
                f"(log {self.log})")


def live_supervisor(state: RunState) -> SupervisorRecord | None:
    """The run's recorded supervisor while it runs as itself (pid and create time)."""
    record = state.record.supervisor
    return record if record is not None and is_alive(record.identity) else None


def refusal(state: RunState, env: Mapping[str, str] = os.environ) -> str | None:
    """Why this run (with no live supervisor) cannot be given one now, and what to do; None
    when it can."""
    record, run, command = state.record, state.run_id, state.plan.command
    down = f"`{command} down {run}`"
    if record.state in (RunPhase.STOPPING, RunPhase.STOPPED):
        return (f"run {run} is {record.state.value}: there is nothing to supervise; {down} "
                "removes what is left of it")
    if record.state is RunPhase.FAILED:
        return (f"run {run} failed (bring-up, or its supervisor stopped it after a failure): "
                f"there is nothing to supervise; `{command} logs {run}` and events.jsonl in "
                f"{state.directory} say why, {down} removes it; launch it again")
    if not run_is_live(record):
        return (f"nothing of run {run} runs any more (no process it recorded is alive): there "
                f"is nothing to supervise; {down} removes its state; `{command} launch` starts "
                "a new run")
    if record.launcher is not None and is_alive(record.launcher):
        doing = ("brings it up and hands it to its supervisor itself"
                 if record.state is RunPhase.STARTING else
                 "is handing it to its supervisor")
        return (f"run {run} is still starting: its `launch` (pid {record.launcher.pid}) "
                f"{doing}; wait for it (`{command} status {run}`)")
    if record.state not in (RunPhase.RUNNING, RunPhase.DEGRADED):
        return (f"run {run} never finished starting ({record.state.value}): its `launch` died "
                f"during bring-up, before every replica passed its gates, and nothing proves "
                f"what runs; {down} stops what it started; launch it again")
    if state.plan.api_key_set:
        key = env.get(API_KEY_ENV)
        if not key:
            return (f"run {run}'s router wants an API key: set {API_KEY_ENV} to the key it was "
                    "launched with (the supervisor's admin calls would be refused without it)")
        if _router_refuses(state, key):
            return (f"run {run}'s router refuses the key in {API_KEY_ENV} (401): set it to the "
                    "key the run was launched with")
    return None


def _router_refuses(state: RunState, key: str) -> bool:
    """The run's live router answers 401 to its admin API with this key (a dead or silent
    router cannot say: the supervisor restarts it with this key)."""
    router = state.record.router
    if router is None or not is_alive(router.identity):
        return False
    status, _ = http_json("GET", router.url + "/workers", timeout=3.0,
                          headers={"Authorization": f"Bearer {key}"})
    return status == 401


def resume(state: RunState, *, say: Callable[[str], None],
           timeout_s: float = SUPERVISOR_HANDOFF_S,
           env: Mapping[str, str] = os.environ, argv: list[str] | None = None) -> Resumed:
    """Give the run a supervisor again, or find it has one: Resumed. NotSupervisable (nothing
    started) or ResumeFailed (the one started is stopped; the run as it was). argv: another
    program to start instead of the supervisor (tests)."""
    with _exclusive(state.directory, state.run_id):
        try:
            state = RunState.load(state.directory)  # as it is now, under the lock
        except RunFileError as exc:
            raise NotSupervisable(f"run {state.run_id}: {exc}") from None
        alive = live_supervisor(state)
        if alive is not None:
            return Resumed(state.run_id, True, True, alive.identity.pid,
                           supervising_since=alive.supervising_since)
        why = refusal(state, env)
        if why is not None:
            raise NotSupervisable(why)
        previous = state.record.supervisor
        state.api_key = env.get(API_KEY_ENV) if state.plan.api_key_set else None
        return _start(state, previous.identity.pid if previous else None, say, timeout_s,
                      argv)


def _start(state: RunState, previous_pid: int | None, say: Callable[[str], None],
           timeout_s: float, argv: list[str] | None) -> Resumed:
    def tick(pid: int, waited: float) -> None:
        say(f"supervisor pid {pid} started; waiting for its first sweep (at most "
            f"{timeout_s:.0f} s; log {state.logs / 'supervisor.log'})" if waited == 0 else
            f"still waiting for supervisor pid {pid}: {waited:.0f} s")

    with _stop_on_signals() as stop:
        start = start_supervisor(state, timeout_s=timeout_s, stop=stop, tick=tick, argv=argv)
    resumed = Resumed(state.run_id, False, False, start.pid, previous_pid, str(start.log))
    if not start.supervising and start.exit_code is None and \
            supervising(state, start.started.identity):
        start.supervising = True  # it got there as the wait ended
    if start.supervising:
        resumed.supervised = True
        record = RunState.load(state.directory).record.supervisor
        resumed.supervising_since = record.supervising_since if record else None
        return resumed
    why = start.why_not()
    stopped = start.exit_code is not None or stop_unsupervising(start)
    resumed.error = why
    state.event(Event.SUPERVISOR_RESUME_FAILED, pid=start.pid, previous_pid=previous_pid,
                exit=start.exit_code, interrupted=start.interrupted, stopped=stopped)
    left = ("" if start.exit_code is not None else
            f"; it is stopped (SIGKILL: pid {start.pid})" if stopped else
            f"; it could not be stopped: pid {start.pid} may still run")
    raise ResumeFailed(
        f"{why}{left}\nrun {state.run_id} goes on serving, unsupervised (nothing was torn "
        f"down); `{state.plan.command} supervise {state.run_id}` tries again, "
        f"`{state.plan.command} down {state.run_id}` stops it", resumed,
        interrupted=start.interrupted)


@contextlib.contextmanager
def _exclusive(directory: Path, run_id: str) -> Iterator[None]:
    """The run directory locked against another `supervise` of it (flock: released when this
    process ends, however)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise NotSupervisable(f"run {run_id}: cannot open {directory}: "
                              f"{exc.strerror or exc}") from None
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise NotSupervisable(
                        f"another `supervise` of run {run_id} still holds it after "
                        f"{LOCK_WAIT_S:.0f} s; try again") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM set the event while the wait runs (main thread only), instead of
    cutting the wait where nothing would stop what it started."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in handlers:
        signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
