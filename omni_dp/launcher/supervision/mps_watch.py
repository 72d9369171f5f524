"""Is the run's MPS daemon fit to serve, and what a fault means: `--on-mps-fault restart` (a new
daemon and every client, within the restart budget) or `fail` (stop the run, state kept). A
fault taints every client, so it is decided once for all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omni_dp.launcher.supervision.crew import Crew, Probe
from omni_dp.launcher.supervision.restart_policy import GiveUp, RestartPolicy
from omni_dp.mps.daemon import DaemonHealth, DaemonRecord
from omni_dp.mps.faults import FaultScanner


def describe_fault(health: DaemonHealth) -> str | None:
    """The fault in words; None when the daemon is fit."""
    if health.ok:
        return None
    if not health.alive:
        return "the MPS daemon is gone"
    if not health.reachable:
        return f"the MPS daemon does not answer ({health.error})"
    return "MPS faults in the logs: " + "; ".join(health.faults[:3])


@dataclass(frozen=True)
class FaultAction:
    action: str  # restart | fail
    fault: str  # in words
    restarts_in_window: int  # daemon restarts that count against the budget, before this one
    over_budget: bool
    delay: float = 0.0  # before the restart


class MpsWatch:
    def __init__(self, policy: RestartPolicy, on_fault: str) -> None:
        self.policy = policy
        self.on_fault = on_fault  # restart | fail
        self.restarts: tuple[float, ...] = ()  # when each daemon restart began
        self.scanner = FaultScanner()

    def health(self, probe: Probe, record: DaemonRecord, logs: Iterable[Path]) -> DaemonHealth:
        """The daemon's own health, with the MPS errors the replicas logged since last time."""
        health = probe.daemon_health(record)
        health.faults += self.scanner.new_faults(logs)
        return health

    def check(self, crew: Crew, record: DaemonRecord, logs: Iterable[Path]) -> FaultAction | None:
        """One sweep's look at the daemon: None when it is fit; else the fault is said and
        recorded, a `fail` stops the run, and a `restart` is returned for the caller to run."""
        fault = describe_fault(self.health(crew.probe, record, logs))
        if fault is None:
            return None
        act = self.decide(crew.clock(), fault)
        crew.state.event("mps_fault", detail=fault, action=act.action,
                         restarts_in_window=act.restarts_in_window)
        crew.say(f"{fault}: every replica is suspect")
        if act.action == "restart":
            return act
        if act.over_budget:
            crew.say(f"{act.restarts_in_window} MPS restarts within {self.policy.window:.0f} s: "
                     "the restart budget is spent; stopping the run")
        crew.fail()
        return None

    def decide(self, now: float, fault: str) -> FaultAction:
        """What to do about a fault found now (a restart is remembered against the budget)."""
        decision = self.policy.decide(self.restarts, now)
        if isinstance(decision, GiveUp):
            return FaultAction("fail", fault, decision.restarts, over_budget=True)
        in_window = decision.attempt - 1
        if self.on_fault == "fail":
            return FaultAction("fail", fault, in_window, over_budget=False)
        self.restarts = decision.history
        return FaultAction("restart", fault, in_window, over_budget=False, delay=decision.delay)
