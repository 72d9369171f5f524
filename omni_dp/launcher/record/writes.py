"""Every change to a run's record, as a value: what a caller wants written (a replica started, a
restart decided, a field changed, an event), and `apply`, the one function that writes it.

A write is a value so that who makes it and who applies it can differ: `omni-dp launch` before
the supervisor runs applies its own (RunState.write applies at once); once the supervision
loop runs, a thread's write is handed to the loop, which applies it between its checks and only
then lets the thread go on (supervision/outcomes.py). Either way the record changes in one
place, in the order the writes were made, and a caller reads its own writes back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_dp.launcher.record.events import Event
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import (
    Desired,
    GatewayRecord,
    GpuRecord,
    PlanRecord,
    ReplicaRecord,
    ReplicaState,
    RunPhase,
    RunRecord,
    can_transition,
)


class Recorded(Protocol):
    """What apply writes into: a run's state (record/state.py's RunState)."""

    @property
    def record(self) -> RunRecord: ...

    def commit(self, record: RunRecord) -> None: ...

    def append_event(self, line: str) -> None: ...


@dataclass(frozen=True)
class EventWritten:
    """One line of events.jsonl (its time is when it is applied: the file stays in order)."""

    name: Event
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaChanged:
    """One replica's fields (typed; a `state` change checked against the lifecycle)."""

    index: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class ReplicaStarted:
    """A new process of replica `index` was spawned: its identity and process group; what was
    known of its predecessor (processes, KV, attachment, memory) is forgotten."""

    index: int
    identity: ProcessIdentity
    pgid: int


@dataclass(frozen=True)
class RestartDecided:
    """The restart policy let replica `index` restart: its restart history (it alone is
    charged), and the event saying so (`group`: the dependents restarted with it)."""

    index: int
    history: tuple[float, ...]
    reason: str
    attempt: int
    backoff_s: float
    group: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReplicaBack:
    """A restarted replica, healthy again, was offered back to the router: the restart is
    done (events.jsonl says so, with its new pid and whether the router took it)."""

    index: int
    in_router: bool
    gates: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaDown:
    """Replica `index` is down (the next sweep tries again) — unless the lifecycle, as the
    record is when this is applied, says it cannot be."""

    index: int
    error: str


@dataclass(frozen=True)
class RecordsReplaced:
    """Top-level records (router, supervisor, launcher, share, gateway), typed."""

    fields: dict[str, Any]


@dataclass(frozen=True)
class GatewayChanged:
    """The gateway record as change(current): two registrations never drop each other's."""

    change: Callable[[GatewayRecord | None], GatewayRecord]


@dataclass(frozen=True)
class DaemonStarted:
    """The MPS daemon now serving record.gpu's slot (it replaces the one before)."""

    record: DaemonRecord


@dataclass(frozen=True)
class FollowerAdded:
    """A follower proven attached to the share leader_pid published; applied, True when that
    share is the recorded one."""

    index: int
    leader_pid: int


@dataclass(frozen=True)
class PhaseSet:
    phase: RunPhase


@dataclass(frozen=True)
class ScaleSet:
    """The replica list after a scale, with the plan and GPU slots it follows."""

    replicas: tuple[ReplicaRecord, ...]
    plan: PlanRecord
    gpus: tuple[GpuRecord, ...]


@dataclass(frozen=True)
class PlanSet:
    """The plan after a change that keeps the replicas (a model update)."""

    plan: PlanRecord


@dataclass(frozen=True)
class DesiredSet:
    """What the running change wants the run to be (None: the change ended, or none runs)."""

    desired: Desired | None


Write = (EventWritten | ReplicaChanged | ReplicaStarted | RestartDecided | ReplicaBack
         | ReplicaDown | RecordsReplaced | GatewayChanged | DaemonStarted | FollowerAdded
         | PhaseSet | ScaleSet | PlanSet | DesiredSet)


def apply(write: Write, state: Recorded) -> object:
    """Write it: the record (run.json at once), then what events.jsonl says of it. The caller
    holds the state's lock. What the write answers (FollowerAdded: whether it was added)."""
    before = state.record
    if isinstance(write, FollowerAdded):
        share = before.share
        if share is None or share.leader_pid != write.leader_pid:
            return False
    after = next_record(write, before)
    if after is not before:
        state.commit(after)
    event = said(write, before)
    if event is not None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event.name.value,
                           **event.fields})
        state.append_event(line)
    return True if isinstance(write, FollowerAdded) else None


def next_record(write: Write, record: RunRecord) -> RunRecord:
    """The record once the write is applied (the same record when it changes nothing)."""
    match write:
        case ReplicaChanged(index, fields):
            return record.with_replica(index, **fields)
        case ReplicaStarted(index, identity, pgid):
            return record.with_replica(
                index, identity=identity, pgid=pgid, processes=(), state=ReplicaState.STARTING,
                kv_tokens=None, mps_attached=None, memory_bytes=None)
        case RestartDecided(index, history):
            return record.with_replica(index, restarts=history)
        case ReplicaDown(index, error):
            if not can_transition(record.replicas[index].state, ReplicaState.DOWN):
                return record
            return record.with_replica(index, state=ReplicaState.DOWN, last_error=error)
        case RecordsReplaced(fields):
            return record.with_records(**fields)
        case GatewayChanged(change):
            return record.with_records(gateway=change(record.gateway))
        case DaemonStarted(daemon):
            return record.with_daemon(daemon)
        case FollowerAdded(index):
            assert record.share is not None
            return record.with_records(share=record.share.with_follower(index))
        case PhaseSet(phase):
            return record if phase is record.state else record.with_phase(phase)
        case ScaleSet(replicas, plan, gpus):
            return record.with_scale(replicas, plan, gpus)
        case PlanSet(plan):
            return record.with_plan(plan)
        case DesiredSet(desired):
            return record if desired == record.desired else record.with_desired(desired)
    return record


def said(write: Write, before: RunRecord) -> EventWritten | None:
    """What events.jsonl says of the write (`before`: the record it was applied to)."""
    match write:
        case EventWritten():
            return write
        case ReplicaStarted(index, identity):
            replica = before.replicas[index]
            return EventWritten(Event.REPLICA_STARTED, {
                "replica": index, "pid": identity.pid, "cpus": replica.cpus,
                "port": replica.port})
        case RestartDecided(index, _, reason, attempt, backoff_s, group):
            return EventWritten(Event.RESTART_STARTED, {
                "replica": index, "reason": reason, "attempt": attempt, "backoff_s": backoff_s,
                **({"group": list(group)} if len(group) > 1 else {})})
        case ReplicaBack(index, in_router, gates):
            return EventWritten(Event.RESTART_COMPLETED, {
                "replica": index, "pid": before.replicas[index].pid, "in_router": in_router,
                "gates": list(gates)})
    return None
