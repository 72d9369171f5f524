"""`omni-dp launch` after planning: create the run, bring it up, then supervise or detach.

Exit codes: 0 stopped cleanly (foreground) or up and handed to a detached supervisor,
3 something started and then failed (torn down; the state directory is kept for diagnosis),
130 interrupted during bring-up (SIGINT/SIGTERM/`omni-dp down`) and cleaned up.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Protocol

from omni_dp.contract import ExitCode
from omni_dp.launcher.bringup.replicas import ReplicaControl
from omni_dp.launcher.bringup.steps import BringUpFailed, StartProgress, bring_up
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.planning.plan import LaunchPlan
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.detached import start_supervisor
from omni_dp.launcher.supervision.supervisor import Supervisor
from omni_dp.launcher.teardown import teardown
from omni_dp.launcher.views.summary import RunSummary, run_summary
from omni_dp.mps.daemon import MpsDaemonError
from omni_dp.runfile import RunFileError, RunPhase

INTERRUPTED = 130  # the shell's 128 + SIGINT: interrupted during bring-up, and cleaned up


class _Interrupted(Exception):
    pass


class TickingProgress(StartProgress, Protocol):
    """A StartProgress that shows itself on its own while bring-up waits (a context: it ticks
    inside `with`)."""

    def __enter__(self) -> TickingProgress: ...

    def __exit__(self, *exc: object) -> None: ...


class LaunchOutput(Protocol):
    """Where launch reports, chosen by the CLI (text, JSON log lines, `--detach --json`)."""

    progress: TickingProgress  # ticking while bring-up waits

    def say(self, line: str) -> None:
        """A line of what is happening (also the supervisor's, in the foreground)."""

    def summary(self, summary: RunSummary) -> None:
        """The run as it stands once bring-up passed."""

    def ready(self, summary: RunSummary) -> None:
        """The run is verified and supervised: the last thing a detached launch says."""


def launch(plan: LaunchPlan, out: LaunchOutput) -> int:
    say = out.say
    state = RunState.create(plan)
    state.api_key = plan.options.api_key  # in memory: for the router's env and admin calls
    state.event(Event.RUN_CREATED, plan=plan.to_json())
    replicas = ReplicaControl(state)
    # SIGTERM/SIGINT during bring-up interrupt it; afterwards they only set `stop`, which the
    # supervisor (or the hand-off) acts on, so no moment is left where a signal kills this
    # process without a teardown.
    stop = threading.Event()
    bringing_up = True

    def on_signal(*_) -> None:
        stop.set()
        if bringing_up:
            raise _Interrupted()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        with out.progress:
            up = bring_up(plan, state, replicas, out.say, out.progress)
        bringing_up = False
        reap = [up.router.popen, *replicas.popens.values()]
    except (BringUpFailed, GateFailed, MpsDaemonError, _Interrupted, OSError) as exc:
        bringing_up = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown
        interrupted = isinstance(exc, _Interrupted)
        why = "interrupted" if interrupted else str(exc)
        say("bring-up interrupted; tearing down" if interrupted else f"bring-up FAILED: {why}")
        if not interrupted:
            state.set_phase(RunPhase.FAILED)
        state.event(Event.BRINGUP_FAILED, error=why)
        result = teardown(state, drain_timeout=state.requested_drain(5.0),
                          keep_state=not interrupted, say=say,
                          reap=[*replicas.popens.values()])
        for line in result.leftovers:
            say(f"left behind: {line}")
        if not interrupted:
            stopped = ("everything started was stopped" if result.clean else
                       "some processes could not be stopped (above)")
            say(f"{stopped}; the state is kept for diagnosis in {state.directory} (logs/, "
                f"events.jsonl); remove it with `{plan.command} down {state.run_id}`")
        return INTERRUPTED if interrupted and result.clean else ExitCode.RUNTIME

    summary = run_summary(plan, state, up.checks)
    out.summary(summary)
    if plan.options.detach:
        code = _hand_off(state, reap, stop, say)
        if code == ExitCode.OK:
            out.ready(summary)
        return code
    say("supervising in the foreground; Ctrl-C (or SIGTERM) tears the run down")
    out.ready(summary)
    return Supervisor(state, replicas, detached=False, say=say, reap=reap,
                      stop_requested=stop).run()


def _hand_off(state: RunState, reap: list, stop: threading.Event,
              say: Callable[[str], None]) -> int:
    """Start the detached supervisor and return once it supervises: recorded in run.json AND
    through a first sweep of its loop (its heartbeat). If it dies first, or a signal comes,
    the run is torn down instead: never "detached" with no one watching."""
    start = start_supervisor(state, stop=stop)
    if start.supervising:
        say(f"detached: supervisor pid {start.pid} is supervising (log {start.log})")
        return ExitCode.OK
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the teardown below must run to its end
    interrupted = start.interrupted
    say("interrupted; tearing the run down" if interrupted else
        f"{start.why_not()}\ntearing the run down")
    # The supervisor may have recorded itself meanwhile: teardown then stops it first (it
    # tears down itself); if not, it carries the run token and goes with the other strays.
    current = _current(state)
    result = teardown(current, drain_timeout=current.requested_drain(5.0),
                      keep_state=not interrupted, say=say, reap=[*reap, start.started.popen])
    for line in result.leftovers:
        say(f"left behind: {line}")
    if not interrupted:
        state.event(Event.HANDOFF_FAILED, supervisor_pid=start.pid, exit=start.exit_code)
        say(f"the state is kept for diagnosis in {state.directory}; remove it with "
            f"`{state.plan.command} down {state.run_id}`"
            if state.directory.exists() else "nothing is left of the run" if result.clean
            else "the run's state is gone; some processes could not be stopped (above)")
    return INTERRUPTED if interrupted and result.clean else ExitCode.RUNTIME


def _current(state: RunState) -> RunState:
    """run.json as it is now; the launcher's own copy if the directory was removed meanwhile
    (a supervisor that tore the run down removes it: the copy still names what to stop)."""
    try:
        return RunState.load(state.directory)
    except RunFileError:
        return state
