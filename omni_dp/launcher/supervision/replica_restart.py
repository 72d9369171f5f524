"""Restarting a replica — and what depends on it — through the gates of bring-up, in a thread
of its own so the others stay watched.

The supervisor hands over the slot's replica group: the replica whose check failed, then its
dependents (slots.run_slots declares them: a weight-sharing leader's followers). Usually that
is the replica alone. The group is taken out of the router → budget and backoff, decided on the
failed replica's own history (the restart is recorded on every member) → stopped in
share_group.stop_waves (followers before their leader) → their ports free → started again in
share_group.start_waves (the leader, then its followers), each with the same block and
environment, each through health → KV equal to the plan → the share checks → (--mps)
attachment → back in the router as soon as its wave passed. A member that fails its gates is
stopped and left down (the next sweep tries again); a later wave, which depends on it, is not
started. Past the budget the whole group is marked failed and stays out of the router.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omni_dp.launcher.gates import GateFailed
from omni_dp.launcher.share_group import start_waves
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.restart_policy import GiveUp
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.runfile import REPLICA_TRANSITIONS, ReplicaState

PORT_FREE_TIMEOUT_S = 60.0


class ReplicaRestart:
    def __init__(self, crew: Crew, router: RouterLink,
                 passed: Callable[[int], None] = lambda index: None) -> None:
        self.crew = crew
        self.router = router
        self.passed = passed  # told when a restarted replica passed every gate

    def __call__(self, index: int, reason: str, group: list[int] | None = None) -> None:
        """The restart thread's body: whatever goes wrong leaves the group down (the next
        sweep tries again), never the supervisor dead."""
        members = list(group or [index])
        try:
            self.through_gates(index, reason, members)
        except Exception as exc:
            if not self.crew.gate.closed:  # once teardown began, failing midway is expected
                for i in members:
                    self._down(i, repr(exc))
                self.crew.state.event("restart_failed", replica=index, group=members,
                                      error=repr(exc))

    def through_gates(self, index: int, reason: str, group: list[int] | None = None) -> None:
        crew, state = self.crew, self.crew.state
        members = list(group or [index])
        history = state.replica(index).restarts
        now = crew.clock()
        for i in members:
            self.router.set_disabled(i, True)
        decision = crew.policy.decide(history, now)
        if isinstance(decision, GiveUp):
            self._give_up(index, members,
                          f"restart budget exhausted ({decision.reason}); last: {reason}")
            return
        for i in members:
            state.update_replica(i, restarts=decision.history if i == index else
                                 crew.policy.remember(state.replica(i).restarts, now))
        state.event("restart_started", replica=index, reason=reason, attempt=decision.attempt,
                    backoff_s=decision.delay,
                    **({"group": members} if len(members) > 1 else {}))
        if crew.stop.wait(decision.delay):
            return
        crew.replicas.stop(members, crew.drain_timeout)  # followers before their leader
        for i in members:
            port = state.replica(i).port
            if not self._wait_port_free(port):
                for j in members:
                    self._failed(j, f"port {port} still busy after {PORT_FREE_TIMEOUT_S:.0f} s"
                                 + ("" if j == i else f" (replica {i}'s)"))
                return
        waves = start_waves(state.record, members)
        up: list[int] = []
        for n, wave in enumerate(waves):
            passed = self._wave(wave)
            if passed is None:  # teardown began: nothing more is started
                return
            up += passed
            if len(passed) < len(wave):  # what follows depends on what failed here
                for later in waves[n + 1:]:
                    for i in later:
                        self._failed(i, f"not started: replica(s) "
                                     f"{', '.join(str(j) for j in wave if j not in passed)} "
                                     "it depends on did not come back")
                break
        if up:
            crew.replicas.measure_memory(up)

    def _wave(self, wave: list[int]) -> list[int] | None:
        """Start these replicas (together, unless the run starts one after another) and pass
        each through the gates; each that passed is back in the router. The ones that passed;
        None when teardown began."""
        crew = self.crew
        batches = ([[i] for i in wave] if crew.state.plan.start == "sequential" else [wave])
        passed = []
        for batch in batches:
            with crew.gate.open() as may:
                if not may:
                    return None
                for i in batch:
                    crew.replicas.start(i)
            for i in batch:
                try:
                    self._gates(i)
                except GateFailed as exc:
                    crew.replicas.stop([i], crew.drain_timeout)
                    self._failed(i, str(exc))
                    continue
                passed.append(i)
                self._back(i)
        return passed

    def _gates(self, index: int) -> None:
        crew = self.crew
        crew.replicas.wait_healthy(index, crew.state.supervision.start_timeout)
        crew.replicas.record_processes(index)
        crew.replicas.check_kv([index])
        crew.replicas.share_gate(index)
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

    def _give_up(self, index: int, members: list[int], why: str) -> None:
        try:
            self.crew.replicas.stop(members, self.crew.drain_timeout)
        except GateFailed as exc:  # it stays recorded; teardown names it
            why += f"; {exc}"
        for i in members:
            said = why if i == index else f"{why} (of replica {index}, which it depends on)"
            self.crew.state.update_replica(i, state=ReplicaState.FAILED, last_error=said)
            self.crew.state.event("replica_failed", replica=i, reason=said)
            self.crew.say(f"replica {i}: {said}; it stays out of the router")

    def _failed(self, index: int, error: str) -> None:
        first = error.splitlines()[0]
        self._down(index, first)
        self.crew.state.event("restart_failed", replica=index, error=error)
        self.crew.say(f"replica {index}: restart failed: {first}")

    def _down(self, index: int, error: str) -> None:
        """Down (the next sweep tries again), unless the lifecycle says it cannot be."""
        state = self.crew.state
        now = state.replica(index).state
        if now is ReplicaState.DOWN or ReplicaState.DOWN in REPLICA_TRANSITIONS[now]:
            state.update_replica(index, state=ReplicaState.DOWN, last_error=error)

    def _wait_port_free(self, port: int) -> bool:
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while self.crew.probe.port_taken(port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
