"""Restarting a replica — and what depends on it — through the gates of bring-up, in a thread
of its own so the others stay watched.

The supervisor hands over the slot's replica group: the replica whose check failed, then its
dependents that may restart (slots.run_slots declares them: a weight-sharing leader's
followers; slots.restart_group leaves a failed or stopped one out). Usually that is the
replica alone. The group is taken out of the router → (a follower restarted without its
leader: the leader must be alive, else the follower waits, down and charged nothing, for the
sweep to restart the leader's group) → budget and backoff, decided on and charged to the
failed replica's own history only → stopped in
share_group.stop_waves (followers before their leader) → their ports free → started again in
share_group.start_waves (the leader, then its followers), each with the same block and
environment, each through health → KV equal to the plan → the share checks → (--mps)
attachment to its own GPU's daemon → back in the router as soon as its wave passed. A member
that fails its gates is stopped and left down (the next sweep tries again); a later wave, which
depends on it, is not started. Past the budget the whole group is marked failed and stays out
of the router. An error no gate names leaves what passed up, stops what was started and not
gated, and leaves the rest down. Once teardown began nothing more is written or said:
teardown owns the run. The thread writes nothing itself: each record change it makes (the
decision, the start, down, back: record/writes.py) is applied by the loop, which it waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.planning.share_group import LEADER, start_waves
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.writes import ReplicaBack, ReplicaDown, RestartDecided
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.indices import SharedIndices
from omni_dp.launcher.supervision.outcomes import GatesPassed, GaveUp, Outcomes
from omni_dp.launcher.supervision.restart_policy import GiveUp
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.runfile import ReplicaState

PORT_FREE_TIMEOUT_S = 60.0


@dataclass
class Progress:
    """What one restart has done to its members so far: what an unexpected error must undo."""

    started: set[int] = field(default_factory=set)  # started (or tried to), not stopped since
    passed: set[int] = field(default_factory=set)  # passed every gate, back in service


class ReplicaRestart:
    def __init__(self, crew: Crew, router: RouterLink, outcomes: Outcomes) -> None:
        self.crew = crew
        self.router = router
        self.outcomes = outcomes  # what the loop applies: a pass, a restart given up
        # followers said to wait for their gone leader; shared by every restart thread
        self._waiting = SharedIndices()

    def __call__(self, index: int, reason: str, group: list[int] | None = None) -> None:
        """The restart thread's body: whatever goes wrong leaves the group down (the next
        sweep tries again), never the supervisor dead."""
        members = list(group or [index])
        progress = Progress()
        try:
            self.through_gates(index, reason, members, progress)
        except Exception as exc:
            if not self.crew.gate.closed:  # once teardown began, failing midway is expected
                self._unexpected(index, members, progress, exc)

    def _unexpected(self, index: int, members: list[int], progress: Progress,
                    exc: Exception) -> None:
        """An error no gate names (a spawn that raised, a run.json that cannot be written, a
        bug): what passed its gates stays up, in the router; every other member is stopped —
        started and not gated, or still its old process (the error came before the stop) —
        so that nothing serves, or passes for healthy at the next sweep, without having passed
        the gates (a leader back that way would serve with no share recorded); they are down,
        the next sweep restarts them. Only what could not be stopped may still answer: healthy
        at a sweep, it is put back in the router."""
        crew = self.crew
        error = repr(exc)
        down = [i for i in members if i not in progress.passed]
        ungated = sorted(i for i in down if i in progress.started)
        stop_error = None
        if down:
            try:
                crew.replicas.stop(down, crew.drain_timeout)  # followers before their leader
            except Exception as again:  # GateFailed: a survivor, still recorded
                stop_error = str(again) if isinstance(again, GateFailed) else repr(again)
        for i in down:
            self._down(i, f"restart failed: {error}")
        if stop_error is not None:
            self.router.left_out(down)
        crew.state.event(Event.RESTART_FAILED, replica=index, group=members, error=error,
                         passed=sorted(progress.passed), stopped=down, ungated=ungated,
                         **({"stop_error": stop_error} if stop_error else {}))
        kept = sorted(progress.passed)
        crew.say(f"replica {index}: restart failed: {error}"
                 + (f"; replica(s) {', '.join(map(str, kept))} passed and stay" if kept else "")
                 + (f"; replica(s) {', '.join(map(str, down))} not through the gates: "
                    "stopped, down, the next sweep restarts them" if down else "")
                 + (f" (not all stopped: {stop_error})" if stop_error else ""))

    def through_gates(self, index: int, reason: str, group: list[int] | None = None,
                      progress: Progress | None = None) -> None:
        crew, state = self.crew, self.crew.state
        members = list(group or [index])
        progress = progress if progress is not None else Progress()
        for i in members:
            self.router.set_disabled(i, True)
        if self._leader_gone(members):
            return
        self._waiting.difference_update(members)
        now = crew.clock()
        decision = crew.policy.decide(state.replica(index).restarts, now)
        if isinstance(decision, GiveUp):
            self._give_up(index, members,
                          f"restart budget exhausted ({decision.reason}); last: {reason}")
            return
        # Only the failed replica's history is charged: a dependent restarted with it did not
        # fail on its own (its own crashes are charged when it restarts alone).
        state.write(RestartDecided(index, decision.history, reason, decision.attempt,
                                   decision.delay, tuple(members)))
        if crew.stop.wait(decision.delay):
            return
        self.cycle(members, progress)

    def cycle(self, members: list[int], progress: Progress, *,
              relaunch: Callable[[int], None] | None = None) -> list[int] | None:
        """Stop the members (followers before their leader), wait for their ports, start
        them again in share_group.start_waves through every gate of bring-up, each back in the
        router as its wave passed; `relaunch(i)` changes a member's record (argv, env, block)
        between its stop and its start (a model update, a new CPU block). The members that
        passed (None when teardown began); a member that failed is down, said."""
        crew, state = self.crew, self.crew.state
        crew.replicas.stop(members, crew.drain_timeout)  # followers before their leader
        for i in members:
            port = state.replica(i).port
            if not self._wait_port_free(port):
                for j in members:
                    self._failed(j, f"port {port} still busy after {PORT_FREE_TIMEOUT_S:.0f} s"
                                 + ("" if j == i else f" (replica {i}'s)"))
                return []
        if relaunch is not None:
            for i in members:
                relaunch(i)
        waves = start_waves(state.record, members)
        up: list[int] = []
        for n, wave in enumerate(waves):
            passed = self.start_wave(wave, progress)
            if passed is None:  # teardown began: nothing more is started
                return None
            up += passed
            if len(passed) < len(wave):  # what follows depends on what failed here
                for later in waves[n + 1:]:
                    for i in later:
                        self._failed(i, f"not started: replica(s) "
                                     f"{', '.join(str(j) for j in wave if j not in passed)} "
                                     "it depends on did not come back")
                break
        if up:
            try:
                crew.replicas.measure_memory(up)
            except Exception as exc:  # every member passed: a figure missing is no failure
                state.event(Event.MEMORY_MEASURE_FAILED, replicas=up, error=repr(exc))
                crew.say(f"replica(s) {', '.join(map(str, up))}: restarted, but measuring "
                         f"their memory failed: {exc!r}")
        return up

    def _leader_gone(self, members: list[int]) -> bool:
        """A follower restarted without its leader (a restart of the leader would take it
        along) whose leader is gone: it would attach to nothing and fail closed, each try
        charged. It waits, down and charged nothing: the sweep sees the dead leader once no
        restart owns it, and restarts the leader's whole group, this follower with it."""
        state = self.crew.state
        if not state.plan.share_weights or LEADER in members:
            return False
        if self.crew.probe.alive(state.replica(LEADER).identity):
            return False
        why = f"waiting for its leader (replica {LEADER}), which is gone"
        new = self._waiting.add_new(members)  # one step: no two threads say the same wait
        for i in members:
            self._down(i, why)
        # down, out of the router: put back should it answer healthy after all
        self.router.left_out(members)
        if new and not self.crew.gate.closed:
            for i in new:
                state.event(Event.RESTART_DEFERRED, replica=i, reason=why)
            self.crew.say(f"replica(s) {', '.join(map(str, new))}: not restarted alone, {why}; "
                          f"the restart of replica {LEADER}'s group brings it back")
        return True

    def start_wave(self, wave: list[int], progress: Progress) -> list[int] | None:
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
                    progress.started.add(i)  # before: a start that raises midway is stopped
                    crew.replicas.start(i)
            for i in batch:
                try:
                    ran = self._gates(i)
                except GateFailed as exc:
                    crew.replicas.stop([i], crew.drain_timeout)
                    progress.started.discard(i)
                    self._failed(i, str(exc))
                    continue
                self._back(i, ran)
                progress.passed.add(i)
                passed.append(i)
        return passed

    def _gates(self, index: int) -> list[str]:
        """Every gate of bring-up, in its order; the names of those that ran."""
        crew = self.crew
        crew.replicas.wait_healthy(index, crew.state.supervision.start_timeout)
        crew.replicas.record_processes(index)
        crew.replicas.check_kv([index])
        ran = ["health", "processes", "KV"]
        if crew.replicas.sharing:
            crew.replicas.share_gate(index)
            ran.append("share")
        gpu = crew.state.replica(index).gpu
        if crew.state.record.daemon(gpu) is not None:  # against its own GPU's daemon only
            report = crew.replicas.verify_attachment(gpu)
            if not report.passed:
                raise GateFailed("MPS attachment FAILED: " + "; ".join(
                    report.problems + [p for v in report.replicas for p in v.problems]))
            ran.append("MPS attachment")
        return ran

    def _back(self, index: int, gates: list[str]) -> None:
        state = self.crew.state
        self.outcomes.report(GatesPassed(index))
        # The reason for the restart is resolved (it stays in events.jsonl, restart_started).
        state.update_replica(index, state=ReplicaState.HEALTHY, last_error=None)
        back = self.router.enable(index)
        pid = state.replica(index).pid
        state.write(ReplicaBack(index, back, tuple(gates)))
        done = f"replica {index}: restarted (pid {pid}), passed its gates ({', '.join(gates)}), "
        self.crew.say(done + ("back in the router" if back else
                              "but NOT back in the router (above); retrying at every sweep"))

    def _give_up(self, index: int, members: list[int], why: str) -> None:
        if self.crew.gate.closed:  # teardown stops them and owns their state
            return
        try:
            self.crew.replicas.stop(members, self.crew.drain_timeout)
        except GateFailed as exc:  # it stays recorded; teardown names it
            why += f"; {exc}"
        self.outcomes.report(GaveUp(index, tuple(members), why))  # the loop records it


    def _failed(self, index: int, error: str) -> None:
        if self.crew.gate.closed:  # teardown began: failing midway is expected, not news
            return
        first = error.splitlines()[0]
        self._down(index, first)
        self.crew.state.event(Event.RESTART_FAILED, replica=index, error=error)
        self.crew.say(f"replica {index}: restart failed: {first}")

    def _down(self, index: int, error: str) -> None:
        """Down (the next sweep tries again), unless the lifecycle says it cannot be or
        teardown began (teardown owns the state then)."""
        if not self.crew.gate.closed:  # the lifecycle is checked as the loop applies it
            self.crew.state.write(ReplicaDown(index, error))

    def _wait_port_free(self, port: int) -> bool:
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while self.crew.probe.port_taken(port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def give_up(crew: Crew, outcome: GaveUp) -> None:
    """The loop's side of a spent budget: every member failed, said, out of the router."""
    for i in outcome.members:
        said = (outcome.why if i == outcome.index else
                f"{outcome.why} (of replica {outcome.index}, which it depends on)")
        # failed, the leader no longer publishes: run.json's share is null (with_replica)
        crew.state.update_replica(i, state=ReplicaState.FAILED, last_error=said)
        crew.state.event(Event.REPLICA_FAILED, replica=i, reason=said)
        crew.say(f"replica {i}: {said}; it stays out of the router")
