"""Starting the detached supervisor and waiting until it supervises: what `launch --detach`
hands a run to, and what `omni-dp supervise` starts again for a run whose supervisor died.

The supervisor is `python -m omni_dp.launcher.supervision.supervisor RUN_DIR` in a session of
its own, its output appended to logs/supervisor.log, with the run's environment contract: the
run id and token (omni_dp/contract.py), the router's API key and the fleet gateway's (by
environment, as the router gets its key: never argv, never disk). It supervises once run.json
names it (pid AND create time) with `supervising_since` set: its loop ran a first sweep.
What to do when it does not (tear the run down, or leave it serving) is the caller's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_dp.contract import API_KEY_ENV, RUN_ID_ENV
from omni_dp.launcher.bringup.gates import describe_exit, log_tail
from omni_dp.launcher.planning.options import GATEWAY_KEY_ENV
from omni_dp.launcher.processes.ours import Started, child_env, signal_ours, spawn
from omni_dp.launcher.record.state import RunState
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.runfile import RunFileError

SUPERVISOR_HANDOFF_S = 30.0  # start, record itself, one sweep (health of every replica)
SUPERVISOR_MODULE = "omni_dp.launcher.supervision.supervisor"
TICK_S = 5.0  # how often a waiting caller hears how long it has waited


@dataclass
class SupervisorStart:
    """How one start of the detached supervisor went."""

    started: Started
    log: Path
    supervising: bool  # run.json names it, supervising
    exit_code: int | None = None  # it exited first (Popen's: negative for a signal)
    interrupted: bool = False  # the caller's stop came first
    timeout_s: float = SUPERVISOR_HANDOFF_S

    @property
    def pid(self) -> int:
        return self.started.pid

    def why_not(self) -> str:
        """Why it is not supervising, in words (with its log's tail when it died)."""
        if self.exit_code is not None:
            return (f"the detached supervisor (pid {self.pid}) {describe_exit(self.exit_code)}"
                    f" before it was supervising; last lines of {self.log}:\n"
                    f"{log_tail(self.log)}")
        if self.interrupted:
            return f"interrupted before the detached supervisor (pid {self.pid}) supervised"
        return (f"the detached supervisor (pid {self.pid}) did not start supervising within "
                f"{self.timeout_s:.0f} s; last lines of {self.log}:\n{log_tail(self.log)}")


def supervisor_env(state: RunState) -> dict[str, str]:
    """The detached supervisor's environment: the caller's, less what marks another run, plus
    the run's id and token, the router's key (state.api_key) and the gateway's."""
    extra = {RUN_ID_ENV: state.run_id}
    if state.api_key is not None:  # by environment, as to the router: never argv, never disk
        extra[API_KEY_ENV] = state.api_key
    if os.environ.get(GATEWAY_KEY_ENV):  # the gateway's: the supervisor's, never a replica's
        extra[GATEWAY_KEY_ENV] = os.environ[GATEWAY_KEY_ENV]
    return child_env(extra, state.token)


def start_supervisor(state: RunState, *, timeout_s: float = SUPERVISOR_HANDOFF_S,
                     stop: threading.Event | None = None,
                     tick: Callable[[int, float], None] | None = None,
                     argv: list[str] | None = None) -> SupervisorStart:
    """Start the detached supervisor of `state`'s run and return once it supervises, exits,
    `stop` is set, or timeout_s passed (then it may still be running: see stop_unsupervising).
    tick(its pid, seconds waited) once it started (0) and every TICK_S while waiting. argv:
    another program to start instead (tests)."""
    log = state.logs / "supervisor.log"
    started = spawn(argv or [sys.executable, "-m", SUPERVISOR_MODULE, str(state.directory)],
                    supervisor_env(state), log)
    result = SupervisorStart(started, log, supervising=False, timeout_s=timeout_s)
    begun = time.monotonic()
    if tick is not None:
        tick(started.pid, 0.0)
    next_tick = begun + TICK_S
    while True:
        now = time.monotonic()
        if supervising(state, started.identity):
            result.supervising = True
            return result
        code = started.popen.poll()
        if code is not None:
            # it may have recorded itself supervising just before it exited: it did not stay
            result.exit_code = code
            return result
        if stop is not None and stop.is_set():
            result.interrupted = True
            return result
        if now - begun >= timeout_s:
            return result
        if tick is not None and now >= next_tick:
            tick(started.pid, now - begun)
            next_tick += TICK_S
        time.sleep(0.05)


def supervising(state: RunState, identity: ProcessIdentity) -> bool:
    """run.json names this process as the run's supervisor, through its first sweep."""
    try:
        record = RunState.load(state.directory).record.supervisor
    except RunFileError:  # removed meanwhile (a supervisor that tore the run down removes it)
        return False
    return record is not None and record.identity == identity and \
        record.supervising_since is not None


def stop_unsupervising(start: SupervisorStart, timeout_s: float = 5.0) -> bool:
    """SIGKILL the started supervisor, by pid and create time, if it still runs without
    supervising; never SIGTERM, on which a supervisor tears its run down. True when it is gone
    (or was never left running)."""
    if start.started.popen.poll() is None and is_alive(start.started.identity):
        signal_ours(start.started.identity, signal.SIGKILL)
    try:
        start.started.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True
