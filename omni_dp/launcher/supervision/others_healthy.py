"""Which other replicas are not healthy now, and why: what a day-two change looks at before it
takes a replica out of the router. Kubernetes' maxUnavailable counts the broken ones too: a
replica the sweep is restarting (or the router ejected) is already out of service, so taking
another out could leave nothing to route to.

Healthy means all three: HEALTHY in the supervisor's record, its process alive (a kill -9 is
seen here before the next sweep records it), and — where the router answers GET /workers —
routable there. A failed replica (out of its restart budget), or a stopped one, that no restart
owns is hopeless: nothing brings it back on its own, so waiting for it is pointless.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.router_link import Routing
from omni_dp.launcher.supervision.slots import LEFT_OUT, Busy, Slot
from omni_dp.records import Record, Shape
from omni_dp.runfile import ReplicaRecord, ReplicaState


@dataclass(frozen=True)
class NotHealthy(Record):
    """Another replica that is not healthy now (as the change_waiting event says it)."""

    JSON_SHAPE = Shape(keys={"index": "replica"})

    index: int
    why: str  # short, for the waiting line: "restarting", "its process is gone", …
    last_error: str | None  # the record's, for the failure's message
    hopeless: bool  # failed or stopped, and no restart owns it


def not_healthy(crew: Crew, busy: Busy, routing: dict[int, Routing] | None,
                indices: list[int]) -> list[NotHealthy]:
    """Those of `indices` that are not healthy (routing: None when the router did not
    answer, then the record and the process table alone decide)."""
    found = []
    for index in indices:
        record = crew.state.replica(index)
        why = _why(crew, record, routing)
        if why is not None:
            hopeless = record.state in LEFT_OUT and not busy.skipped(Slot.replica(index))
            found.append(NotHealthy(index, why, record.last_error, hopeless))
    return found


def _why(crew: Crew, record: ReplicaRecord, routing: dict[int, Routing] | None) -> str | None:
    if record.state is not ReplicaState.HEALTHY:
        return record.state.value
    if not crew.probe.alive(record.identity):
        return "its process is gone"
    if routing is None:
        return None
    seen = routing.get(record.index)
    if seen is None:
        return "not in the router"
    return None if seen.routable else f"not routable: {seen.why}"
