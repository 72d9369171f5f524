"""`omni-dp launch` after planning: create the run, bring it up, then supervise or detach.

Exit codes: 0 stopped cleanly (foreground) or up and handed to a detached supervisor,
3 something started and then failed (torn down; the state directory is kept for diagnosis).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from omni_dp.launcher.bringup import BringUpFailed, bring_up
from omni_dp.launcher.gates import GateFailed
from omni_dp.launcher.plan import LaunchPlan
from omni_dp.launcher.processes import child_env, spawn, stop_processes
from omni_dp.launcher.replicas import ReplicaSet
from omni_dp.launcher.state import RunState, identity_of
from omni_dp.launcher.status import collect, replica_table
from omni_dp.launcher.supervisor import Supervisor
from omni_dp.launcher.teardown import teardown
from omni_dp.mps.daemon import MpsDaemonError

SUPERVISOR_HANDOFF_S = 20.0


class _Interrupted(Exception):
    pass


def _raise_interrupted(*_) -> None:
    raise _Interrupted()


def launch(plan: LaunchPlan, say: Callable[[str], None]) -> int:
    state = RunState.create(plan)
    state.event("run_created", plan=plan.to_json())
    replicas = ReplicaSet(state)
    reap = list(replicas.popens.values())
    previous = {sig: signal.signal(sig, _raise_interrupted)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        router = bring_up(plan, state, replicas, say)
        reap = [router.popen, *replicas.popens.values()]
    except (BringUpFailed, GateFailed, MpsDaemonError, _Interrupted, OSError) as exc:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown
        interrupted = isinstance(exc, _Interrupted)
        why = "interrupted" if interrupted else str(exc)
        say(f"bring-up {'interrupted' if interrupted else 'FAILED'}: {why}")
        if not interrupted:
            state.update(state="failed")
        state.event("bringup_failed", error=why)
        result = teardown(state, drain_timeout=5.0, keep_state=not interrupted, say=say,
                          reap=[*replicas.popens.values()])
        for line in result.leftovers:
            say(f"left behind: {line}")
        if not interrupted:
            say(f"everything started was stopped; the state is kept for diagnosis in "
                f"{state.directory} (logs/, events.jsonl); remove it with "
                f"`omni-dp down {state.run_id}`")
        return 130 if interrupted and result.clean else 3
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    say(summary(plan, state))
    if plan.options.detach:
        return _hand_off(state, reap, say)
    say("supervising in the foreground; Ctrl-C (or SIGTERM) tears the run down")
    return Supervisor(state, replicas, detached=False, say=say, reap=reap).run()


def summary(plan: LaunchPlan, state: RunState) -> str:
    status = collect(state, probe=False)
    for r in status["replicas"]:
        r["health"] = "healthy"
    lines = [
        "",
        replica_table(status["replicas"]),
        "",
        f"endpoint   {plan.router_url}",
        f"try        curl -s {plan.router_url}/v1/audio/speech -H 'Content-Type: "
        "application/json' -d '{\"input\": \"Hello there.\"}' -o hello.wav",
        f"status     omni-dp status {plan.run_id}",
        f"teardown   omni-dp down {plan.run_id}",
    ]
    if plan.options.mps:
        lines.insert(-2, f"mps        omni-dp verify-mps {plan.run_id}   "
                         f"({state.directory / 'mps_attach.txt'})")
    return "\n".join(lines)


def _hand_off(state: RunState, reap: list, say: Callable[[str], None]) -> int:
    """Start the detached supervisor and return once it has taken the run over."""
    log = state.logs / "supervisor.log"
    started = spawn([sys.executable, "-m", "omni_dp.launcher.supervisor", str(state.directory)],
                    child_env({"OMNI_DP_RUN_ID": state.run_id}, state.token), log)
    deadline = time.monotonic() + SUPERVISOR_HANDOFF_S
    while time.monotonic() < deadline:
        current = RunState.load(state.directory)
        if identity_of(current.data.get("supervisor")) == started.identity:
            say(f"detached: supervisor pid {started.pid} (log {log})")
            return 0
        if started.popen.poll() is not None:
            break
        time.sleep(0.05)
    say(f"the detached supervisor did not take over (log {log}); tearing the run down")
    stop_processes([started.identity], state.token, 5.0, reap=[started.popen])
    teardown(state, drain_timeout=5.0, keep_state=True, say=say, reap=reap)
    return 3
