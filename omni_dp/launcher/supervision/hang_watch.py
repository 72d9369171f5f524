"""Replicas the router found hung: it took one out when it accepted a request and answered
nothing within --first-byte-timeout (or stopped mid-answer past --stall-timeout) and failed a
/health check too (GET /workers: `ejected_reason` "hang"). The router lets go of it at once;
the supervisor restarts it through the gates if it has not recovered within HANG_GRACE_S —
the router re-admits a replica whose checks pass again, and a brief stall must not cost a
restart. No I/O here: the supervisor reads /workers and hands the entries over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The router's re-admission (its health checks: --health-successes passes, seconds apart)
# comes well within this; a replica still out as hung after it is not coming back by itself.
HANG_GRACE_S = 15.0


@dataclass(frozen=True)
class HungReplica:
    index: int
    since: float  # when the router ejected it (Unix time)
    error: str  # what the router said


class HangReports:
    """Which replicas are due for a restart as hung: each ejection once, after the grace."""

    def __init__(self, grace_s: float = HANG_GRACE_S) -> None:
        self.grace_s = grace_s
        self.acted_on: dict[int, float] = {}  # replica -> the ejection already restarted for

    def due(self, workers: Iterable[Mapping], now: float) -> list[HungReplica]:
        found = []
        for worker in workers:
            index = replica_index(worker.get("id"))
            since = worker.get("ejected_at")
            if index is None or worker.get("ejected_reason") != "hang" or \
                    not isinstance(since, (int, float)):
                continue
            if now - since < self.grace_s or self.acted_on.get(index) == since:
                continue
            self.acted_on[index] = since
            found.append(HungReplica(index, since, str(worker.get("last_error") or "hung")))
        return found


def replica_index(worker_id: object) -> int | None:
    """The replica index the launcher registers each replica under (its id: "0", "1", …)."""
    return int(worker_id) if isinstance(worker_id, str) and worker_id.isdigit() else None
