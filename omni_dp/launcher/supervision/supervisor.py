"""The supervisor: one object owns the supervision loop and its signals (gunicorn's arbiter);
what it decides and does is in small parts, omni_dp/launcher/supervision/.

Every sweep it checks each slot — each GPU's MPS daemon (with --mps) before its clients, each
replica (process alive by pid + create time, GET /health), the router — and hands a restart to a
thread of its own, so the rest stays watched. A thread keeps the blocking waits and reports
typed outcomes (outcomes.py); the loop alone applies them — and every record write a thread
makes (record/writes.py): the loop is the run record's single writer —, and alone changes its
watches and slots, which follow the record at every sweep. A day-two change is desired state
(in run.json while it runs) that the loop reconciles the run with, one step per sweep, each
chosen from the record as it is then (change_runner.py). A slot is left alone while a restart
owns it or what it depends on (an MPS fault on a GPU restarts every replica of that GPU, and no
other).
SIGTERM/SIGINT: orderly teardown.

Run in the foreground by `omni-dp launch`, or detached as
`python -m omni_dp.launcher.supervision.supervisor RUN_DIR` (what `launch --detach` leaves behind,
and `omni-dp supervise` starts again for a run whose supervisor died: takeover.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from omni_dp.contract import API_KEY_ENV, ExitCode
from omni_dp.launcher.bringup.replicas import ReplicaControl
from omni_dp.launcher.changes.request import ChangeRequest, Step, take
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.change_runner import ChangeRunner
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.death_watch import DeathWatch
from omni_dp.launcher.supervision.hang_watch import HangReports
from omni_dp.launcher.supervision.mps_restart import GroupRestart
from omni_dp.launcher.supervision.mps_watch import MpsWatch
from omni_dp.launcher.supervision.outcomes import (
    GatesPassed,
    Outcomes,
    Posted,
    RouterLeftOut,
    StepEnded,
)
from omni_dp.launcher.supervision.replica_restart import ReplicaRestart, give_up
from omni_dp.launcher.supervision.replica_watch import ReplicaWatch, Seen
from omni_dp.launcher.supervision.restart_policy import RestartPolicy
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.launcher.supervision.slots import (
    CHANGE,
    ROUTER,
    Busy,
    Slot,
    restart_group,
    run_slots,
)
from omni_dp.launcher.supervision.takeover import take_over
from omni_dp.launcher.teardown import teardown
from omni_dp.logs import setup_logging
from omni_dp.procs import ProcessIdentity, identify, is_alive
from omni_dp.runfile import (
    WATCHED,
    ReplicaState,
    RunFileError,
    RunPhase,
    SupervisorRecord,
)

__all__ = ["DeathWatch", "Supervisor", "main"]


@dataclass
class Changing:
    """The change the loop is making: how many steps it began, the one in flight, and the last
    one that passed (the next is chosen from the record: changes/desired.py)."""

    change: ChangeRequest
    made: int = 0
    step: Step | None = None
    last: Step | None = None


def _stamped(line: str) -> None:
    print(f"{time.strftime('%F %T')} {line}", flush=True)


class Supervisor:
    def __init__(self, state: RunState, replicas: ReplicaControl, *, detached: bool,
                 say: Callable[[str], None] = _stamped, reap: list | None = None,
                 stop_requested: threading.Event | None = None) -> None:
        self.state = state
        self.replicas = replicas
        self.detached = detached
        self.say = say
        self.reap = reap if reap is not None else []
        self.stop_requested = stop_requested or threading.Event()
        self.exit_code = 0
        s = state.supervision
        self.interval = s.check_interval
        self.crew = Crew(state, replicas, say, self.stop_requested, self._fail,
                         RestartPolicy.of(s))
        self.busy = Busy(run_slots(state.record))  # the slots a restart thread owns
        self.watches = {r.index: ReplicaWatch(s.restart_after_failures) for r in state.replicas}
        self.router = RouterLink(self.crew)
        self.hangs = HangReports()
        # one watch per GPU's daemon, by GPU slot: its own budget, its own clients' logs
        self.mps = {slot.index: MpsWatch(self.crew.policy, s.on_mps_fault, slot.index)
                    for slot in self.busy.deps.slots if slot.kind == "mps"}
        self.outcomes = Outcomes()  # what the threads report; the loop alone applies it
        self.router.outcomes = self.outcomes
        self.restart_replica = ReplicaRestart(self.crew, self.router, self.outcomes)
        self.restart_group = GroupRestart(self.crew, self.router,
                                          {gpu: w.scanner for gpu, w in self.mps.items()},
                                          self.outcomes)
        self.change = ChangeRunner(self.crew, self.router, self.restart_replica, self.busy)
        self.changing: Changing | None = None  # the change being made, the loop's alone
        self.cut_off: set[int] = set()  # replicas whose restart a dead supervisor left undone

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_requested.set())
        me = identify(os.getpid())
        assert me is not None
        previous = self.state.record.supervisor  # one that died (`omni-dp supervise`), or none
        if previous is not None and previous.identity != me and is_alive(previous.identity):
            # never two at once; and never a teardown: the run is the other one's
            self.say(f"run {self.state.run_id} is supervised by pid {previous.identity.pid}; "
                     "this supervisor stops without touching it")
            return ExitCode.USAGE
        self.state.update(supervisor=SupervisorRecord(me, self.detached))
        self.state.event(Event.SUPERVISOR_STARTED, pid=me.pid, detached=self.detached)
        if previous is not None and previous.identity != me:
            self._take_over(previous)
        watch = DeathWatch()
        self.outcomes.wake = watch.wake  # a thread's report wakes the loop to apply it
        self.outcomes.own(self.state)  # from now on only this thread writes the record
        try:
            self._loop(watch)
        except Exception as exc:  # the loop itself: never leave the run unsupervised silently
            self.exit_code = ExitCode.RUNTIME
            self.state.event(Event.SUPERVISOR_FAILED, error=repr(exc))
            self.say(f"the supervision loop failed ({exc!r}); tearing the run down")
        finally:
            self.outcomes.wake = None
            watch.close()
        return self.shutdown()

    def _take_over(self, previous: SupervisorRecord) -> None:
        """Take back what a supervisor that died left half-done (takeover.py): its cut-off
        restarts are due at the first sweep, its taken-out replicas go back once healthy."""
        try:
            done = take_over(self.crew, previous)
        except Exception as exc:  # never the supervisor dead for it: the sweep goes on
            self.state.event(Event.SUPERVISOR_TAKEOVER_FAILED, error=repr(exc))
            self.say(f"warning: taking over from supervisor pid {previous.identity.pid} "
                     f"failed ({exc!r}); supervising what the record says")
            return
        self.cut_off.update(done.cut_off)
        self.router.not_in_router.update(done.taken_out)
        if done.resumed is not None:  # its next step at the first sweep, from the record
            self.changing = Changing(done.resumed, made=done.steps)

    def _loop(self, watch: DeathWatch) -> None:
        supervising = False
        while not self.stop_requested.is_set():
            try:
                self.sweep()
            except Exception as exc:  # a sweep must never take the supervisor down
                self.state.event(Event.SUPERVISOR_CHECK_FAILED, error=repr(exc))
            if not supervising:  # the heartbeat `launch --detach` waits for before it says so
                supervising = True
                record = self.state.record.supervisor
                # the event first: whoever sees the heartbeat in run.json finds the event
                self.state.event(Event.SUPERVISOR_SUPERVISING, pid=os.getpid())
                self.state.update(supervisor=replace(record, supervising_since=time.time()))
            self._wait(watch)

    def _wait(self, watch: DeathWatch) -> None:
        """Until the next sweep is due (the interval, a watched process's exit, a signal, a
        thread's outcome), applying the threads' record writes meanwhile."""
        deadline = time.monotonic() + self.interval
        while not self.stop_requested.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or watch.wait(self._watched(), left):
                return
            self.apply_outcomes()

    def _watched(self) -> list[ProcessIdentity]:
        """The live processes whose exit should wake the loop at once (none a restart owns)."""
        record = self.state.record
        slots = {Slot.replica(r.index): r.identity for r in record.replicas if r.state in WATCHED}
        slots[ROUTER] = record.router.identity if record.router else None
        slots.update((Slot.mps(d.gpu), d.identity) for d in record.daemons)
        return [i for slot, i in slots.items()
                if i is not None and not self.busy.skipped(slot) and self.crew.probe.alive(i)]

    def shutdown(self) -> int:
        # Teardown owns the run now: a thread's later writes are its own (few: the spawn gate
        # closes below); what it handed the loop before is applied here.
        self.outcomes.release()
        self.apply_outcomes()  # what a thread reported as the loop ended
        if self.changing is not None:  # its step, if one runs, fails against the teardown
            self._end_change("the run is being torn down")
        self.say("tearing the run down")
        self.crew.gate.close()
        failed = self.exit_code != 0  # stopped by a fault: keep the state for diagnosis
        if failed:
            self.state.set_phase(RunPhase.FAILED)
        # `omni-dp down --drain-timeout S` wrote its bound before it signalled us
        drain = self.state.requested_drain(self.crew.drain_timeout)
        result = teardown(self.state, drain_timeout=drain, say=self.say, keep_state=failed,
                          reap=self.reap + list(self.replicas.popens.values()))
        for line in result.leftovers:
            self.say(f"left behind: {line}")
        if failed:
            self.say(f"run stopped after a failure; its state is kept in {self.state.directory}"
                     f" (events.jsonl, logs/); `{self.state.plan.command} down "
                     f"{self.state.run_id}` removes it")
        elif result.clean:
            self.say("run stopped; nothing left behind")
        return self.exit_code if result.clean else ExitCode.RUNTIME

    def _fail(self) -> None:
        """Stop the run with a failure: exit 3, its state kept for diagnosis."""
        self.exit_code = ExitCode.RUNTIME
        self.stop_requested.set()

    # --- one sweep: check every slot nobody restarts, dispatch what is due ------------------

    def apply_outcomes(self) -> None:
        """Apply what the threads reported, in order: the loop is the only one to change its
        watches, and the records a thread's end leaves."""
        for outcome in self.outcomes.take():
            if isinstance(outcome, Posted):  # a thread's record write: it waits for it
                outcome.settle(self.state)
            elif isinstance(outcome, GatesPassed):
                if outcome.index in self.watches:  # gone already: a scale removed it
                    self.watches[outcome.index].reset()
            elif isinstance(outcome, RouterLeftOut):
                self.router.apply_left_out(outcome)
            elif isinstance(outcome, StepEnded):
                self._step_ended(outcome)
            elif not self.crew.gate.closed:  # GaveUp; once teardown began, teardown owns it
                give_up(self.crew, outcome)

    def follow_record(self) -> None:
        """The slots and watches of the run as its record now is (a scale added or removed a
        replica): compared at every sweep, so the change that reshaped the record never
        touches the loop's own state."""
        record = self.state.record
        indices = [r.index for r in record.replicas]
        if sorted(self.watches) == indices:
            return
        for index in indices:
            self.watches.setdefault(index, ReplicaWatch(self.state.supervision
                                                        .restart_after_failures))
        for gone in set(self.watches) - set(indices):
            del self.watches[gone]
        self.busy.deps = run_slots(record)

    def sweep(self) -> None:
        if self.state.removed:
            self.say(f"the run directory {self.state.directory} was removed; tearing the run "
                     "down from memory")
            self.stop_requested.set()
            return
        check = {"replica": lambda slot: self._check_replica(slot.index),
                 "router": lambda _: self._check_router(),
                 "mps": lambda slot: self._check_mps(slot.index)}
        self.apply_outcomes()
        self.follow_record()
        for slot in self.busy.deps.order():
            if self.stop_requested.is_set():
                return
            if not self.busy.skipped(slot):
                # after the look at the slot: a thread that let it go reported before it did
                self.apply_outcomes()
                check[slot.kind](slot)
        self.apply_outcomes()
        self.router.retry_enable(skip=self._replica_skipped)
        self._check_hangs()
        self._check_change()
        healthy = {r.state for r in self.state.replicas} == {ReplicaState.HEALTHY}
        self.state.set_phase(RunPhase.RUNNING if healthy else RunPhase.DEGRADED)

    def _replica_skipped(self, index: int) -> bool:
        return self.busy.skipped(Slot.replica(index))

    def _check_replica(self, index: int) -> None:
        if index >= len(self.state.replicas):  # a scale removed it during this sweep
            return
        record = self.state.replica(index)
        if index in self.cut_off:  # taken over half-restarted: through the gates again
            self.cut_off.discard(index)
            if record.state is ReplicaState.DOWN:
                self._restart(index, record.last_error or "its restart was cut off")
                return
        if record.state not in WATCHED:
            return
        verdict = self.watches[index].observe(record.state, self._look(index))
        if verdict.state is ReplicaState.HEALTHY:  # recovered: the /health error is resolved
            resolved = {} if index in self.router.not_in_router else {"last_error": None}
            self.state.update_replica(index, state=verdict.state, **resolved)
        elif verdict.state is not None:
            self.state.update_replica(index, state=verdict.state, last_error=verdict.error)
        if verdict.restart:
            self._restart(index, verdict.restart)

    def _restart(self, index: int, reason: str) -> None:
        """Hand the replica's restart to a thread: it takes the slot's dependents with it (a
        weight-share leader's followers), but not a failed or stopped one (slots.LEFT_OUT)."""
        group, left = restart_group(self.busy.deps, self.state.record, index)
        others = group[1:]
        words = {ReplicaState.FAILED: "stays failed (out of its own restart budget), out of "
                                      "the router",
                 ReplicaState.STOPPED: "is stopped: nothing of it runs to restart"}
        self.say(f"replica {index}: {reason}; restarting"
                 + (f" with replica(s) {', '.join(map(str, others))}, which depend on it"
                    if others else "")
                 + "".join(f"; replica {i}, which depends on it, "
                           + words.get(self.state.replica(i).state,
                                       f"is {self.state.replica(i).state.value}: left as it is")
                           for i in left))
        for i in left:
            self.state.event(Event.RESTART_LEFT_OUT, replica=i, group_of=index,
                             state=self.state.replica(i).state.value)
        self.state.update_replica(index, state=ReplicaState.RESTARTING, last_error=reason)
        for i in others:
            self.state.update_replica(
                i, state=ReplicaState.RESTARTING,
                last_error=f"restarted with replica {index}, which it depends on ({reason})")
        self.busy.start(Slot.replica(index), self.restart_replica, index, reason, group,
                        name=f"restart-{index}")

    def _look(self, index: int) -> Seen:
        record, probe = self.state.replica(index), self.crew.probe
        if probe.alive(record.identity):
            return Seen(alive=True, health=probe.health(record.url, min(2.0, self.interval)))
        popen = self.replicas.popens.get(index)
        return Seen(alive=False, exit_code=popen.poll() if popen else None)

    def _check_router(self) -> None:
        router = self.state.record.router
        if router is None or self.crew.probe.alive(router.identity):
            return
        delay = self.router.died(router.identity.pid)
        if delay is not None:
            self.busy.start(ROUTER, self.router.restart, delay, self.reap, name="router-restart")

    def _check_change(self) -> None:
        """A day-two change (omni-dp restart, omni-dp scale) as desired state: taken, checked
        against the run it was planned from, what it wants written into run.json; then, each
        sweep with no step in flight, the step that brings the run as it is then closer to it
        (change_runner.py), its blocking part in a thread of its own (the run stays watched),
        its outcome applied here; none left: done. One change at a time (the next waits,
        asked, until this one ended)."""
        if self.busy.holder(CHANGE) is not None:
            return  # a step runs
        self.apply_outcomes()  # the step that just ended reported before it let go
        if self.changing is None:
            if self.stop_requested.is_set():
                return
            change = take(self.state.directory, self._change_refused)
            if change is None:
                return
            self.changing = Changing(change)
            error = self.change.begin(change)
            if error is not None:
                self._end_change(error)
                return
        changing = self.changing
        if changing.step is not None:  # its thread let go without a report (never expected)
            self._end_change(f"step {changing.made} ended without saying how")
            return
        step, error = self.change.next(changing.change, changing.last)
        if step is None:
            self._end_change(error)
            return
        changing.made += 1
        error = self.change.dispatch(changing.change, changing.made, step)
        if error is not None:
            self._end_change(error)
            return
        changing.step = step
        self.busy.start(CHANGE, self._run_step, changing.change, changing.made, step,
                        name=f"change-{changing.change.id}-{changing.made}")

    def _run_step(self, change: ChangeRequest, n: int, step: Step) -> None:
        """A step's thread: its blocking part, reported."""
        self.outcomes.report(self.change.run_step(change, n, step))

    def _step_ended(self, ended: StepEnded) -> None:
        changing = self.changing
        if changing is None or changing.step is None or changing.change.id != ended.change \
                or changing.made != ended.step:
            return  # not the step the loop handed out (the change ended meanwhile)
        step, changing.step = changing.step, None
        error = self.change.apply(changing.change, ended, step)
        if error is not None:
            self._end_change(error)
        else:
            changing.last = step

    def _end_change(self, error: str | None) -> None:
        assert self.changing is not None
        change, self.changing = self.changing.change, None
        self.change.end(change, error)

    def _change_refused(self, why: str) -> None:
        """A request that does not parse: refused whole, before any step, and said."""
        self.state.event(Event.CHANGE_REFUSED, error=why)
        self.crew.say(f"change refused: {why}")

    def _check_hangs(self) -> None:
        """Replicas the router found hung and has not re-admitted within the grace: each
        restarted through the gates (its own health checks may not have seen it yet: a
        stopped process's listening socket still accepts)."""
        router = self.state.record.router
        if router is None or self.busy.skipped(ROUTER):
            return
        workers = self.crew.probe.router_workers(router.url, self.state.api_key)
        for hung in self.hangs.due(workers or [], self.crew.clock()):
            record = next((r for r in self.state.replicas if r.index == hung.index), None)
            if record is None or record.state not in WATCHED or \
                    self._replica_skipped(hung.index):
                continue
            self.state.event(Event.REPLICA_HUNG, replica=hung.index, since=hung.since,
                             error=hung.error)
            self._restart(hung.index, f"hung: the router took it out ({hung.error})")

    def _check_mps(self, gpu: int) -> None:
        """GPU slot `gpu`'s daemon: a fault restarts it with its clients, that GPU's replicas."""
        record = self.state.record.daemon(gpu)
        act = self.mps[gpu].check(self.crew, record) if record else None
        if act is not None:  # every replica depending on this daemon goes with it, no other
            slot = Slot.mps(gpu)
            group = [s.index for s in self.busy.deps.dependents(slot) if s.kind == "replica"]
            for i in group:  # written here, the thread only waits: the loop writes the record
                self.state.update_replica(i, state=ReplicaState.RESTARTING, last_error=act.fault)
            self.busy.start(slot, self.restart_group, record, act.fault, group, act.delay,
                            name=f"mps-restart-{gpu}")


def main(argv: list[str]) -> int:
    """Entry of the detached supervisor:
    `python -m omni_dp.launcher.supervision.supervisor RUN_DIR`."""
    try:
        state = RunState.load(Path(argv[0]))
    except (IndexError, RunFileError) as exc:
        print(f"omni-dp supervisor: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    # The router's key comes by environment (`launch` set it): never from run.json or argv.
    state.api_key = os.environ.get(API_KEY_ENV) if state.plan.api_key_set else None
    say = _stamped
    if state.plan.log_format == "json":  # as `launch --log-format json` asked
        setup_logging("info", "json", stream=sys.stdout)
        say = logging.getLogger("omni_dp.supervisor").info
    if state.plan.api_key_set and state.api_key is None:
        say(f"warning: the run's router wants an API key but {API_KEY_ENV} is not set here: "
            "the router will refuse this supervisor's admin calls")
    return Supervisor(state, ReplicaControl(state), detached=True, say=say).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
