"""Restarting one replica through the gates of bring-up, in a thread of its own so the others
stay watched: out of the router → budget and backoff → its group stopped → its port free →
started again with the same block and environment → health → KV equal to the plan → (--mps)
attachment → back in the router. Past the budget it is marked failed and stays out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omni_dp.launcher.gates import GateFailed
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.restart_policy import GiveUp
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.runfile import ReplicaState

PORT_FREE_TIMEOUT_S = 60.0


class ReplicaRestart:
    def __init__(self, crew: Crew, router: RouterLink,
                 passed: Callable[[int], None] = lambda index: None) -> None:
        self.crew = crew
        self.router = router
        self.passed = passed  # told when a restarted replica passed every gate

    def __call__(self, index: int, reason: str) -> None:
        """The restart thread's body: whatever goes wrong leaves the replica down (the next
        sweep tries again), never the supervisor dead."""
        try:
            self.through_gates(index, reason)
        except Exception as exc:
            if not self.crew.gate.closed:  # once teardown began, failing midway is expected
                self.crew.state.update_replica(index, state=ReplicaState.DOWN,
                                               last_error=repr(exc))
                self.crew.state.event("restart_failed", replica=index, error=repr(exc))

    def through_gates(self, index: int, reason: str) -> None:
        crew, state = self.crew, self.crew.state
        history = state.replica(index).restarts
        now = crew.clock()
        self.router.set_disabled(index, True)
        decision = crew.policy.decide(history, now)
        if isinstance(decision, GiveUp):
            self._give_up(index, f"restart budget exhausted ({decision.reason}); last: {reason}")
            return
        state.update_replica(index, restarts=decision.history)
        state.event("restart_started", replica=index, reason=reason, attempt=decision.attempt,
                    backoff_s=decision.delay)
        if crew.stop.wait(decision.delay):
            return
        crew.replicas.stop([index], crew.drain_timeout)
        port = state.replica(index).port
        if not self._wait_port_free(port):
            self._failed(index, f"port {port} still busy after {PORT_FREE_TIMEOUT_S:.0f} s")
            return
        with crew.gate.open() as may:
            if not may:
                return
            crew.replicas.start(index)
        try:
            self._gates(index)
        except GateFailed as exc:
            crew.replicas.stop([index], crew.drain_timeout)
            self._failed(index, str(exc))
            return
        self._back(index)

    def _gates(self, index: int) -> None:
        crew = self.crew
        crew.replicas.wait_healthy(index, crew.state.supervision.start_timeout)
        crew.replicas.record_processes(index)
        crew.replicas.check_kv([index])
        if crew.state.record.mps is not None:
            report = crew.replicas.verify_attachment()
            if not report.passed:
                raise GateFailed("MPS attachment FAILED: " + "; ".join(
                    report.problems + [p for v in report.replicas for p in v.problems]))

    def _back(self, index: int) -> None:
        state = self.crew.state
        self.passed(index)
        # The reason for the restart is resolved (it stays in events.jsonl, restart_started).
        state.update_replica(index, state=ReplicaState.HEALTHY, last_error=None)
        back = self.router.enable(index)
        pid = state.replica(index).pid
        state.event("restart_completed", replica=index, pid=pid, in_router=back)
        done = f"replica {index}: restarted (pid {pid}), passed health and KV checks, "
        self.crew.say(done + ("back in the router" if back else
                              "but NOT back in the router (above); retrying at every sweep"))

    def _give_up(self, index: int, why: str) -> None:
        try:
            self.crew.replicas.stop([index], self.crew.drain_timeout)
        except GateFailed as exc:  # it stays recorded; teardown names it
            why += f"; {exc}"
        self.crew.state.update_replica(index, state=ReplicaState.FAILED, last_error=why)
        self.crew.state.event("replica_failed", replica=index, reason=why)
        self.crew.say(f"replica {index}: {why}; it stays out of the router")

    def _failed(self, index: int, error: str) -> None:
        first = error.splitlines()[0]
        self.crew.state.update_replica(index, state=ReplicaState.DOWN, last_error=first)
        self.crew.state.event("restart_failed", replica=index, error=error)
        self.crew.say(f"replica {index}: restart failed: {first}")

    def _wait_port_free(self, port: int) -> bool:
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while self.crew.probe.port_taken(port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
