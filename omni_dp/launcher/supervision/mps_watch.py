"""Is one GPU's MPS daemon fit to serve, and what a fault means: `--on-mps-fault restart` (a
new daemon and every client on that GPU, within that GPU's restart budget) or `fail` (stop the
run, state kept). A fault taints every client of the daemon, so it is decided once for all of
them; the other GPUs' daemons and replicas are not its clients, so it says nothing of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omni_dp.launcher.record.events import Event
from omni_dp.launcher.supervision.crew import Crew, Probe
from omni_dp.launcher.supervision.restart_policy import GiveUp, RestartPolicy
from omni_dp.mps.daemon import DaemonHealth, DaemonRecord
from omni_dp.mps.faults import FaultScanner


def describe_fault(health: DaemonHealth, gpu: str | None = None) -> str | None:
    """The fault in words (naming the GPU when given); None when the daemon is fit."""
    if health.ok:
        return None
    of = f" of {gpu}" if gpu else ""
    if not health.alive:
        return f"the MPS daemon{of} is gone"
    if not health.reachable:
        return f"the MPS daemon{of} does not answer ({health.error})"
    return f"MPS faults in the logs{of}: " + "; ".join(health.faults[:3])


@dataclass(frozen=True)
class FaultAction:
    action: str  # restart | fail
    fault: str  # in words
    restarts_in_window: int  # daemon restarts that count against the budget, before this one
    over_budget: bool
    delay: float = 0.0  # before the restart


class MpsWatch:
    """The watch over GPU slot `gpu`'s daemon: its own restart history (a fault on another
    GPU never spends this one's budget) and its own scanner of its clients' logs."""

    def __init__(self, policy: RestartPolicy, on_fault: str, gpu: int = 0) -> None:
        self.policy = policy
        self.on_fault = on_fault  # restart | fail
        self.gpu = gpu
        self.restarts: tuple[float, ...] = ()  # when each restart of this daemon began
        self.scanner = FaultScanner()

    def logs(self, crew: Crew) -> list[Path]:
        """The logs of this GPU's replicas: the daemon's clients, and only they."""
        return [crew.state.logs / r.log for r in crew.state.record.replicas_on(self.gpu)]

    def health(self, probe: Probe, record: DaemonRecord, logs: Iterable[Path]) -> DaemonHealth:
        """The daemon's own health (its control.log), with the MPS errors its clients logged
        since last time."""
        health = probe.daemon_health(record)
        health.faults += self.scanner.new_faults(logs)
        return health

    def check(self, crew: Crew, record: DaemonRecord) -> FaultAction | None:
        """One sweep's look at the daemon: None when it is fit; else the fault is said and
        recorded, a `fail` stops the run, and a `restart` is returned for the caller to run."""
        run = crew.state.record
        gpu = run.gpu_title(self.gpu)
        fault = describe_fault(self.health(crew.probe, record, self.logs(crew)), gpu)
        if fault is None:
            return None
        act = self.decide(crew.clock(), fault)
        crew.state.event(Event.MPS_FAULT, gpu=self.gpu, detail=fault, action=act.action,
                         restarts_in_window=act.restarts_in_window)
        clients = ", ".join(str(r.index) for r in run.replicas_on(self.gpu))
        crew.say(f"{fault}: " + ("every replica is suspect" if gpu is None else
                                 f"its replica(s) {clients} are suspect, the other GPUs' not"))
        if act.action == "restart":
            return act
        if act.over_budget:
            crew.say(f"{act.restarts_in_window} MPS restarts"
                     + (f" on {gpu}" if gpu else "")
                     + f" within {self.policy.window:.0f} s: the restart budget is spent; "
                     "stopping the run")
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
