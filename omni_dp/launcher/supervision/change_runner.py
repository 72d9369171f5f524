"""The supervisor makes a day-two change (omni_dp/launcher/changes) as desired state: once the
change is taken (and the run found to be the one it was planned from), what it wants is written
into run.json (`desired`, a DesiredSet), and each sweep with no step in flight the loop asks
changes.desired.next_step for the one step that brings the run as it is then closer to it
(begin, next, dispatch, apply, end: the loop alone writes what a change records around its
steps), until none is left. The step's blocking part runs in a thread of its own (run_step) so
the rest of the run stays watched, and reports a StepEnded the loop applies. While a step works
on a replica it holds that replica's slot: the sweep leaves it alone, and the step waits for a
restart the sweep began to end first.

- restart: out of the router → drained (the router's in-flight count for it reaches 0, or the
  drain bound) → stopped → its record changed when the step brings a new launch (a model
  update, a new CPU block) → started through every gate of bring-up → back in the router;
- add: recorded, into the router (out of rotation), started through the gates, then in;
- remove: out of the router, drained, stopped, out of the router and the gateway for good, and
  gone from the record (the highest-numbered first, so the others keep their numbers).
Before a restart or a remove takes its replica (and its group) out, every other replica must be
healthy (others_healthy.py): the step waits for that, says so (change_waiting, then
change_waited), at most the change's wait_healthy, and fails on a failed replica at once.
A step that fails ends the change there, recorded failed and said, and what it wanted is
cleared: what passed stays (as an operator's restart that failed half-way, the run keeps the
replicas that passed and the failed one is down, which the sweep tries again); reconciling on
would repeat the failed step against the same cause, sweep after sweep, with nobody asking.
Operator restarts are not charged to a replica's restart budget.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from omni_dp.launcher.changes.desired import desired_of, next_step
from omni_dp.launcher.changes.request import ChangeRequest, Step, finish, stale_basis
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.others_healthy import NotHealthy, not_healthy
from omni_dp.launcher.supervision.outcomes import StepEnded
from omni_dp.launcher.supervision.replica_restart import Progress, ReplicaRestart
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.launcher.supervision.slots import Busy, Slot, replica_group, run_slots
from omni_dp.runfile import Desired, GpuRecord, PlanRecord, ReplicaState

SLOT_WAIT_S = 600.0  # for a restart the sweep began on the same replica to end
WAIT_POLL_S = 0.5  # how often a step waiting for the others looks again


@dataclass
class Waiting:
    """One step's wait for the other replicas: since when, and whom it said it waits for."""

    since: float
    said: set[int] = field(default_factory=set)


class StepFailed(Exception):
    """A step that did not complete; the message says which and why."""


class ChangeRunner:
    def __init__(self, crew: Crew, router: RouterLink, restart: ReplicaRestart,
                 busy: Busy) -> None:
        self.crew = crew
        self.router = router
        self.restart = restart
        self.busy = busy  # the loop's slots follow a reshaped record at its next sweep

    # --- the change, as the loop makes it: one step per thread, the rest its own -----------

    def __call__(self, change: ChangeRequest) -> None:
        """The whole change in the calling thread, as the loop makes it (each step chosen from
        the run as it is then); what goes wrong is recorded."""
        error, n, last = self.begin(change), 0, None
        while error is None:
            step, error = self.next(change, last)
            if step is None or error is not None:
                break
            n += 1
            error = self.dispatch(change, n, step) or \
                self.apply(change, self.run_step(change, n, step), step)
            last = step
        self.end(change, error)

    def begin(self, change: ChangeRequest) -> str | None:
        """The loop: the change taken, said; checked against the run it was planned from, then
        what it wants written into run.json. Why it ends before any step, else None."""
        self.crew.state.event(Event.CHANGE_STARTED, change=change.id, kind=change.kind,
                              summary=change.summary,
                              steps=[s.to_json() for s in change.steps])
        self.crew.say(f"change {change.id}: {change.summary}")
        if self.crew.stop.is_set() or self.crew.gate.closed:
            return "the run is being torn down"
        record = self.crew.state.record
        stale = stale_basis(change, record)
        if stale is not None:
            return stale
        try:
            self.crew.state.set_desired(desired_of(change, record))
        except Exception as exc:  # an unwritable run.json, a request that does not fit: said
            return f"{type(exc).__name__}: {exc}"
        return None

    def desired(self, change: ChangeRequest) -> Desired | None:
        """What the change wants, as run.json keeps it (None: not this change's)."""
        desired = self.crew.state.record.desired
        return desired if desired is not None and desired.change == change.id else None

    def next(self, change: ChangeRequest, last: Step | None) -> tuple[Step | None, str | None]:
        """The loop, with no step in flight: the step that brings the run as it is now closer
        to what the change wants (None: there), or why the change ends here — the same step
        again right after it passed (the run did not follow it: never made twice)."""
        desired = self.desired(change)
        if desired is None:
            return None, "what the change wants is gone from run.json"
        step = next_step(desired, self.crew.state.record)
        if step is not None and last is not None and \
                (step.action, step.replica) == (last.action, last.replica):
            return None, (f"replica {step.replica} is still not as change {change.id} wants it "
                          f"after its {step.action} passed")
        return step, None

    def dispatch(self, change: ChangeRequest, n: int, step: Step) -> str | None:
        """The loop, before step n's thread: said, and what it records first (an added
        replica); why the change ends here instead, else None."""
        if self.crew.stop.is_set() or self.crew.gate.closed:
            return "the run is being torn down"
        try:
            self.crew.state.event(Event.CHANGE_STEP, change=change.id, step=n,
                                  action=step.action, replica=step.replica)
            if step.action == "add":
                self._record_added(change, step)
        except Exception as exc:  # an unwritable run.json: said, never fatal
            return f"{type(exc).__name__}: {exc}"
        return None

    def run_step(self, change: ChangeRequest, n: int, step: Step) -> StepEnded:
        """The step's thread: its blocking waits (the others healthy, the drain, the stop, the
        gates); how it ended, for the loop to apply. Never raises."""
        started = time.monotonic()
        error, removed = None, None
        try:
            if step.action == "remove":
                removed, error = self._remove(change, step)
            else:
                {"restart": self._restart, "add": self._add}[step.action](change, step)
        except StepFailed as exc:
            error = str(exc)
        except Exception as exc:  # a bug or an unwritable run.json: said, never fatal
            error = f"{type(exc).__name__}: {exc}"
        return StepEnded(change.id, n, round(time.monotonic() - started, 2), error, removed)

    def apply(self, change: ChangeRequest, ended: StepEnded, step: Step) -> str | None:
        """The loop: what the step's thread reported, in the record (a removed replica gone
        from it) and the events; why the change ends here, else None."""
        try:
            if ended.removed is not None:
                state = self.crew.state
                state.set_scale(state.replicas[:ended.removed],
                                self._plan_with(ended.removed, change), self._gpus(change))
            if ended.error is not None:
                return ended.error
            self.crew.state.event(Event.CHANGE_STEP_DONE, change=change.id, step=ended.step,
                                  action=step.action, replica=step.replica,
                                  seconds=ended.seconds)
        except Exception as exc:  # an unwritable run.json: said, never fatal
            return f"{type(exc).__name__}: {exc}"
        return None

    def end(self, change: ChangeRequest, error: str | None) -> None:
        """The loop: the plan the run now follows, what the change wanted cleared, and how it
        ended, recorded, said (cleared first: a supervisor that dies between the two finds a
        running change with nothing to resume, and records it failed)."""
        state = self.crew.state
        desired = self.desired(change)
        try:
            if error is None and desired is not None and desired.plan != state.plan:
                state.set_plan(desired.plan)  # a model update's engine arguments
            if desired is not None:
                state.set_desired(None)
        except Exception as exc:  # an unwritable run.json: said, never fatal
            error = error or f"{type(exc).__name__}: {exc}"
        if self.crew.gate.closed and error is None and change.steps:
            error = "the run is being torn down"
        finish(state.directory, change, error)
        if error:
            state.event(Event.CHANGE_FAILED, change=change.id, error=error)
            self.crew.say(f"change {change.id} failed: {error}")
        else:
            state.event(Event.CHANGE_DONE, change=change.id)
            self.crew.say(f"change {change.id} done: {change.summary}")

    # --- the steps --------------------------------------------------------------------------

    def _restart(self, change: ChangeRequest, step: Step) -> None:
        members = self.restart_group(step.replica)
        with self._taking_out(change, step.replica, members):
            for i in members:
                self._out_and_drained(change, i)
                if self.crew.state.replica(i).state is not ReplicaState.RESTARTING:
                    self.crew.state.update_replica(i, state=ReplicaState.RESTARTING)
            desired = self.desired(change)
            relaunch = (lambda i: self._relaunch(i, desired)) if desired is not None else None
            passed = self.restart.cycle(members, Progress(), relaunch=relaunch)
        if passed is None:
            raise StepFailed("the run is being torn down")
        failed = [i for i in members if i not in passed]
        if failed:
            raise StepFailed(f"replica {', '.join(map(str, failed))} did not pass its gates "
                             f"after the restart: {self._last_error(failed[0])}")

    def _record_added(self, change: ChangeRequest, step: Step) -> None:
        """The loop, before an add step's thread: the new replica in the record."""
        state = self.crew.state
        assert step.added is not None  # an add step carries it (Step.__post_init__)
        state.set_scale((*state.replicas, step.added),
                        self._plan_with(len(state.replicas) + 1, change), self._gpus(change))

    def _add(self, change: ChangeRequest, step: Step) -> None:
        """Into the router (out of rotation), started through the gates (recorded already:
        dispatch)."""
        record = step.added
        assert record is not None
        refused = self.router.add(record.index, record.url)
        if refused is not None:
            raise StepFailed(refused)
        with self._holding(record.index):
            passed = self.restart.start_wave([record.index], Progress())
        if not passed:
            raise StepFailed(f"replica {record.index} did not pass its gates: "
                             f"{self._last_error(record.index)}")
        try:
            self.crew.replicas.measure_memory(passed)
        except Exception as exc:  # it passed: a figure missing is no failure
            self.crew.state.event(Event.MEMORY_MEASURE_FAILED, replicas=passed, error=repr(exc))

    def _remove(self, change: ChangeRequest, step: Step) -> tuple[int, str | None]:
        """Out, drained, stopped, gone from the router: the replica stopped, for the loop to
        drop from the record (apply), and why the step still failed (the router kept it)."""
        index = step.replica  # the highest-numbered one: next_step chose it from the record
        with self._taking_out(change, index, [index]):
            self._out_and_drained(change, index)
            self.crew.replicas.stop([index], change.drain_timeout)
            refused = self.router.remove(index)
            self.router.left_out([index], out=False)
        if refused is None:
            return index, None
        # the run is smaller, but the router still lists it
        return index, (f"replica {index} is stopped and gone from the run, but {refused} "
                       "(its health checks keep it out of rotation)")

    # --- helpers ----------------------------------------------------------------------------

    def restart_group(self, index: int) -> list[int]:
        """The replica and its dependents (a weight-share leader's followers)."""
        return replica_group(run_slots(self.crew.state.record), index)

    @contextmanager
    def _taking_out(self, change: ChangeRequest, index: int, members: list[int]):
        """This replica's slot, once every replica outside `members` is healthy. The wait
        comes before the slot is taken (the sweep must stay free to restart the others: a
        follower's slot held would hold back its leader's restart), and the others are looked
        at again once it is held, should they have changed while it waited for the slot."""
        waiting = Waiting(self.crew.clock())
        while True:
            self._wait_for_others(change, index, members, waiting)
            with self._holding(index):
                if change.wait_healthy == 0 or not self._not_healthy(members):
                    self._waited(change, index, members, waiting)
                    yield
                    return

    def _not_healthy(self, members: list[int]) -> list[NotHealthy]:
        others = [r.index for r in self.crew.state.replicas if r.index not in members]
        routing = self.router.routing() if others else None
        return not_healthy(self.crew, self.busy, routing, others)

    def _wait_for_others(self, change: ChangeRequest, index: int, members: list[int],
                         waiting: Waiting) -> None:
        """Until every replica outside `members` is healthy; StepFailed past the change's
        bound, or at once on a replica nothing brings back on its own. Each one newly waited
        for is an event (change_waiting), which the command says. wait_healthy 0: not waited
        for; whom it did not wait for is said."""
        while unready := self._not_healthy(members):
            if change.wait_healthy == 0:
                self.crew.state.event(Event.CHANGE_NOT_WAITING, change=change.id, replica=index,
                                      taking_out=members, others=[u.to_json() for u in unready])
                return
            waited = self.crew.clock() - waiting.since
            stuck = [u for u in unready if u.hopeless] or (
                unready if waited >= change.wait_healthy else [])
            if stuck:
                raise StepFailed(self._stuck(change, members, stuck, waited))
            if {u.index for u in unready} - waiting.said:
                self.crew.state.event(Event.CHANGE_WAITING, change=change.id, replica=index,
                                      taking_out=members, others=[u.to_json() for u in unready],
                                      bound_s=change.wait_healthy)
                waiting.said.update(u.index for u in unready)
            if self.crew.stop.wait(WAIT_POLL_S) or self.crew.gate.closed:
                raise StepFailed("the run is being torn down")

    def _waited(self, change: ChangeRequest, index: int, members: list[int],
                waiting: Waiting) -> None:
        """The wait is over, every one waited for found healthy: said with how long it took."""
        if waiting.said and change.wait_healthy != 0:
            self.crew.state.event(Event.CHANGE_WAITED, change=change.id, replica=index,
                                  taking_out=members, others=sorted(waiting.said),
                                  seconds=round(self.crew.clock() - waiting.since, 2))

    def _stuck(self, change: ChangeRequest, members: list[int], stuck: list[NotHealthy],
               waited: float) -> str:
        """Why the step did not take its replicas out, and what a person can do about it."""
        state, command = self.crew.state, self.crew.state.plan.command
        out, it = _replicas(members), "it" if len(stuck) == 1 else "them"
        restart = (f"restart {it} first (`{command} restart {state.run_id} "
                   + " ".join(f"--replica {u.index}" for u in stuck) + "`)")
        if stuck[0].hopeless:
            said = "; ".join(f"replica {u.index} is {u.why}" + _last(u.last_error, " (", ")")
                             for u in stuck)
            return (f"{out} not taken out of the router: {said}, and nothing brings {it} back "
                    f"on its own; {restart}, or give `{command} {change.kind}` --wait-healthy 0"
                    f" to take {out} out anyway")
        said = "; ".join(f"replica {u.index} still not healthy ({u.why}"
                         + _last(u.last_error, "; ", "") + ")" for u in stuck)
        return (f"{out} not taken out of the router: {said} after {waited:.0f} s; wait until "
                f"`{command} status {state.run_id}` shows {it} healthy and ask again, "
                f"{restart}, or give `{command} {change.kind}` a longer --wait-healthy (0: "
                f"take {out} out anyway)")

    def _out_and_drained(self, change: ChangeRequest, index: int) -> None:
        """Out of the router (and the gateway), then its in-flight requests given the drain
        bound to finish; the stop drains what is left (SIGTERM). A router that did not take
        it out does not stop the change (a dead router sends nothing; a live one retries what
        the stopped replica refuses), but the event says so, with the router's answer, and no
        drain is claimed."""
        state = self.crew.state
        out = self.router.set_disabled(index, True)
        started = time.monotonic()
        drained = out and self.router.drain(index, change.drain_timeout)
        refused = {} if out else {"error": state.replica(index).last_error}
        state.event(Event.CHANGE_DRAINED, change=change.id, replica=index, out_of_router=out,
                    drained=drained, seconds=round(time.monotonic() - started, 2), **refused)

    def _relaunch(self, index: int, desired: Desired) -> None:
        """Between a member's stop and its start: the launch and generation the change wants
        for it (each member its own: a weight-share follower's argv is not its leader's)."""
        if index >= len(desired.replicas):
            return
        goal = desired.replicas[index]
        self.crew.state.update_replica(index, argv=tuple(goal.argv), env=dict(goal.env),
                                       cpus=goal.cpus, generation=goal.generation)

    def _plan_with(self, replicas: int, change: ChangeRequest) -> PlanRecord:
        """The plan as the record goes through a scale: the wanted one's, counting what is
        there now (each step adds or removes one)."""
        desired = self.desired(change)
        return replace(desired.plan if desired else self.crew.state.plan, replicas=replicas)

    def _gpus(self, change: ChangeRequest) -> tuple[GpuRecord, ...]:
        desired = self.desired(change)
        return desired.gpus if desired else self.crew.state.record.gpus

    def _last_error(self, index: int) -> str:
        state = self.crew.state
        found = next((r for r in state.replicas if r.index == index), None)
        return (found.last_error or "no reason recorded") if found else "gone from the record"

    @contextmanager
    def _holding(self, index: int):
        """This replica's slot, once no restart the sweep began holds it (or what it depends
        on): the sweep leaves it alone meanwhile."""
        slot = Slot.replica(index)
        deadline = time.monotonic() + SLOT_WAIT_S
        while self.busy.skipped(slot) and not self._mine(slot):
            if time.monotonic() > deadline or self.crew.stop.wait(0.1):
                raise StepFailed(f"replica {index} stayed busy with a restart")
        with self.busy.holding(slot):
            yield

    def _mine(self, slot: Slot) -> bool:
        return self.busy.holder(slot) is threading.current_thread()


def _last(error: str | None, before: str, after: str) -> str:
    return f"{before}last error: {error}{after}" if error else ""


def _replicas(indices: list[int]) -> str:
    return ("replica " if len(indices) == 1 else "replicas ") + ", ".join(map(str, indices))
