"""A supervisor that takes a run over from one that died (`omni-dp supervise`): what the dead
one left half-done is taken back, so that nothing stays outside supervision.

The processes themselves are adopted as they are: the sweep watches a replica, the router and
an MPS daemon by pid and create time (pidfds wake it on an exit), whoever's child they are.
What the dead supervisor held only in memory, or in a thread that died with it, is not:

- a replica whose restart (or start, in a scale-up) it was making is in a state no sweep looks
  at (planned, starting, restarting): it is marked down, and the first sweep restarts it
  through every gate (a half-started process never passes for healthy without them);
- a replica the router lists as taken out (the dead one took it out and never put it back) is
  put back by the sweep once it is healthy, as one the router did not take back;
- a day-two change it was making (change.json "running") is resumed when run.json keeps what
  it wants (`desired`, of that change): the new loop reconciles the run with it from the record
  as it is (changes/desired.py), a step the dead one cut off included — a replica it was
  restarting is restarted by the first sweep, and still due when it came back on its old
  launch. A running change without it (the dead supervisor died between taking the change and
  writing what it wants, or was an omni-dp before it) is recorded as failed, said why: what its
  steps did stays, and the next change may be asked for. What a change wanted that no running
  change owns is cleared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from omni_dp.launcher.changes.request import ChangeRequest, finish, read_change
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.hang_watch import replica_index
from omni_dp.runfile import WATCHED, ReplicaState, SupervisorRecord

# The states a restart (or a change's start of a new replica) owns: no sweep checks them.
_OWNED_BY_A_RESTART = (ReplicaState.PLANNED, ReplicaState.STARTING, ReplicaState.RESTARTING)
_WHAT = {ReplicaState.PLANNED: "start (a scale-up's)", ReplicaState.STARTING: "start",
         ReplicaState.RESTARTING: "restart"}


@dataclass
class TakeOver:
    previous_pid: int
    cut_off: list[int] = field(default_factory=list)  # restarted at the first sweep
    taken_out: list[int] = field(default_factory=list)  # put back in the router once healthy
    change: str | None = None  # the id of the change it was making
    resumed: ChangeRequest | None = None  # that change, when it goes on (else: failed)
    steps: int = 0  # the steps of it begun before (the next is numbered after them)


def take_over(crew: Crew, previous: SupervisorRecord) -> TakeOver:
    """Take back what the dead supervisor `previous` left half-done (see the module); says it
    and records `supervisor_resumed` (the old and new pid, and what was taken back)."""
    state = crew.state
    done = TakeOver(previous.identity.pid)
    why = f"the supervisor making it (pid {done.previous_pid}) died"
    for r in state.replicas:
        if r.state not in _OWNED_BY_A_RESTART:
            continue
        if r.state is ReplicaState.PLANNED:  # never started: stopped is its way to down
            state.update_replica(r.index, state=ReplicaState.STOPPED)
        state.update_replica(r.index, state=ReplicaState.DOWN,
                             last_error=f"its {_WHAT[r.state]} was cut off: {why}")
        done.cut_off.append(r.index)
    router = state.record.router
    workers = (crew.probe.router_workers(router.url, state.api_key)
               if router is not None and crew.probe.alive(router.identity) else None)
    for worker in workers or []:
        index = replica_index(worker.get("id")) if isinstance(worker, dict) else None
        if index is not None and index < len(state.replicas) and index not in done.cut_off \
                and worker.get("disabled") is True and state.replica(index).state in WATCHED:
            done.taken_out.append(index)
    _take_change(crew, done, why)
    state.event(Event.SUPERVISOR_RESUMED, pid=os.getpid(), previous_pid=done.previous_pid,
                cut_off=done.cut_off, taken_out=sorted(done.taken_out), change=done.change,
                change_resumed=done.resumed is not None)
    crew.say(f"supervising run {state.run_id} again, after supervisor pid {done.previous_pid}"
             + "".join(f"; {what}" for what in _said(done)))
    return done


def _take_change(crew: Crew, done: TakeOver, why: str) -> None:
    """The change the dead supervisor was making: resumed where run.json keeps what it wants,
    else recorded failed; what it wanted is cleared where no running change owns it."""
    state = crew.state
    change, desired = read_change(state.directory), state.record.desired
    running = change if change is not None and change.state == "running" else None
    if running is not None:
        done.change = running.id
        if desired is not None and desired.change == running.id:
            done.resumed = running
            done.steps = sum(1 for e in state.events() if e.get("event") == Event.CHANGE_STEP
                             and e.get("change") == running.id)
            return
        error = f"cut off: {why}; what its steps did stays"
        finish(state.directory, running, error)
        state.event(Event.CHANGE_FAILED, change=running.id, error=error)
    if desired is not None:
        state.set_desired(None)


def _said(done: TakeOver) -> list[str]:
    listed = lambda indices: ", ".join(map(str, indices))  # noqa: E731
    return ([f"replica(s) {listed(done.cut_off)}: restart cut off, restarted now"]
            if done.cut_off else []) + \
        ([f"replica(s) {listed(done.taken_out)}: out of the router, put back once healthy"]
         if done.taken_out else []) + \
        ([f"change {done.change}: " + ("resumed from the run as it is" if done.resumed
                                        else "cut off, recorded as failed")]
         if done.change else [])
