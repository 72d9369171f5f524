"""What the router knows about each replica: identity, health, and its in-flight count.

The in-flight count lives on the record, not in a policy, and changes only through
`Replica.dispatched()`, a context manager that decrements exactly once whatever happens to the
request (finished, failed, streamed, cancelled).

Requests that find no replica to go to wait on their Backends' `changed` pulse (a Pulse):
pulsed when a replica becomes routable again (`Replica.readmitted`, from the health checks and
the admin's enable), gives back a slot, or is added, and when the router begins stopping.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

log = logging.getLogger("omni_dp.router")


def released(owner: str, count: int) -> None:
    """Called after a counter was decremented: below zero, a slot was released twice."""
    if count < 0:
        log.error("BUG: %s went below zero (%d): an in-flight slot was released twice",
                  owner, count)


class Health(str, Enum):
    UNKNOWN = "unknown"  # not yet checked: not routable
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # ejected: routable again after enough successful checks


class Ejected(str, Enum):
    """Why the router took a replica out of the rotation (GET /workers `ejected_reason`)."""

    FAILURES = "failures"  # --health-failures in a row: checks, connection errors, 502/504
    HANG = "hang"  # accepted a request, answered nothing in time, and failed a /health check
    # --health-failures in a row, the last a refused connection: nothing listens on its port
    # (the process is gone). Not an outlier ejection: never held back by
    # --max-ejection-percent, and not counted against it.
    REFUSED = "refused"

    @property
    def outlier(self) -> bool:
        """An ejection the router decided on how the replica behaves (failures, a hang), bounded
        by --max-ejection-percent; a dead process (refused) is not one."""
        return self is not Ejected.REFUSED


class ReplicaError(ValueError):
    """A replica definition or update that cannot be applied; the message says why."""


class DuplicateReplica(ReplicaError):
    """The id or URL is already in the set (HTTP 409)."""


class Pulse:
    """Wakes every task waiting on it each time pulse() is called.

    A notification, not a poll: waiters cost nothing while nothing changes and wake as soon as
    something does, however many there are (one Event, set once per pulse). A woken waiter
    checks again what it waits for (a few replicas). With nobody waiting a pulse costs an
    attribute read, so it can run at the end of every request.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def pulse(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()

    def next(self) -> asyncio.Event:
        """The event the next pulse sets: check, then take it with no await in between."""
        if self._event is None:
            self._event = asyncio.Event()
        return self._event


def _nothing() -> None:
    pass


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_url(url: str) -> str:
    """An http(s) origin without path, query or credentials; returned without a trailing /."""
    if any(c.isspace() or not c.isprintable() for c in url):  # urlsplit drops some silently
        raise ReplicaError(f"replica URL {url!r} must not contain whitespace or control "
                           "characters")
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise ReplicaError(f"replica URL {url!r} must look like http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplicaError(f"replica URL {url!r} must look like http://HOST:PORT")
    if parts.username or parts.password:
        raise ReplicaError(f"replica URL {url!r} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ReplicaError(f"replica URL {url!r} must not have a path, query or fragment")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ReplicaError(f"replica URL {url!r} has an invalid port") from None
    return f"{parts.scheme}://{parts.netloc}"


def validate_id(replica_id: str) -> str:
    if not _ID.fullmatch(replica_id):  # match() would accept a trailing newline
        raise ReplicaError(
            f"replica id {replica_id!r} must be 1-64 letters, digits, '_', '.' or '-'"
        )
    return replica_id


@dataclass(eq=False)
class Replica:
    id: str
    url: str
    disabled: bool = False
    health: Health = Health.UNKNOWN
    in_flight: int = 0
    lowest_in_flight: int = 0  # the lowest in_flight ever seen: below 0 is a double release
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    num_requests: int = 0
    num_ejections: int = 0
    num_hangs: int = 0  # times found hung (Ejected.HANG)
    ejected_reason: Ejected | None = None  # set while ejected; cleared when re-admitted
    ejected_at: float | None = None  # Unix time of that ejection
    # Set while an ejection was due (failures, hang) but not done, as --max-ejection-percent of
    # the replicas were ejected already: it stays routable. Cleared by a success, or when it
    # is ejected after all.
    ejection_suppressed: Ejected | None = None
    num_suppressed: int = 0  # ejections not done for the bound
    last_error: str | None = None
    removed: bool = False  # set when taken out of the set; in-flight requests still finish
    # Bumped each time it becomes routable again (healthy after unknown or ejected, enabled
    # after disabled): a restarted replica is a new process, which no request has tried yet.
    generation: int = 0
    # Its Backends' pulse: wakes the requests waiting for a replica to go to.
    on_change: Callable[[], None] = field(default=_nothing, repr=False)
    # The set it was added to (for the bound on ejections), or None outside any
    backends: Backends | None = field(default=None, repr=False)

    @property
    def routable(self) -> bool:
        return self.health == Health.HEALTHY and not self.disabled and not self.removed

    def readmitted(self) -> None:
        """It is healthy again, or enabled: a new generation, and the waiting requests woken."""
        self.generation += 1
        self.on_change()

    def dispatched(self) -> _Dispatched:
        """Counts one request in flight to this replica until the `with` block is left."""
        return _Dispatched(self)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "disabled": self.disabled,
            "health": self.health.value,
            "routable": self.routable,
            "in_flight": self.in_flight,
            "requests": self.num_requests,
            "ejections": self.num_ejections,
            "ejected_reason": self.ejected_reason.value if self.ejected_reason else None,
            "ejected_at": self.ejected_at,
            "hangs": self.num_hangs,
            "ejection_suppressed": (self.ejection_suppressed.value
                                    if self.ejection_suppressed else None),
            "ejections_suppressed": self.num_suppressed,
            "generation": self.generation,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }


class _Dispatched:
    """`Replica.dispatched()`: a class, not a generator context manager, as every attempt
    takes one."""

    __slots__ = ("_replica",)

    def __init__(self, replica: Replica) -> None:
        self._replica = replica

    def __enter__(self) -> None:
        replica = self._replica
        replica.in_flight += 1
        replica.num_requests += 1

    def __exit__(self, kind, exc, tb) -> None:
        replica = self._replica
        replica.in_flight -= 1
        replica.lowest_in_flight = min(replica.lowest_in_flight, replica.in_flight)
        released(f"replica {replica.id} in_flight", replica.in_flight)
        replica.on_change()  # a slot is free: a request waiting for one may take it


def _not_counted(replica: Replica, why: Ejected) -> None:
    pass


class Backends:
    """The replicas the router sends to (its backends), replaced as a whole on every change so
    readers never see half an update.

    `max_ejection_percent` bounds the replicas the router's outlier detection (failures, hangs)
    holds ejected at once (health.py, `may_eject`); `on_suppressed` is told of each ejection
    not done for it (the router counts them in its metrics)."""

    def __init__(self, replicas: list[Replica] | None = None,
                 max_ejection_percent: int = 100) -> None:
        self.changed = Pulse()  # a replica may be there for a waiting request now
        self.max_ejection_percent = max_ejection_percent
        self.on_suppressed: Callable[[Replica, Ejected], None] = _not_counted
        self._replicas: tuple[Replica, ...] = tuple(replicas or ())
        for replica in self._replicas:
            replica.on_change = self.changed.pulse
            replica.backends = self

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica_id: str) -> Replica | None:
        return next((r for r in self._replicas if r.id == replica_id), None)

    def routable(self) -> list[Replica]:
        return [r for r in self._replicas if r.routable]

    def holds(self, replica: Replica) -> bool:
        """This very record is in the set (a removed one, or another under its id, is not)."""
        return any(r is replica for r in self._replicas)

    def outlier_ejected(self) -> int:
        """Replicas ejected now by outlier detection (failures, hang): what the bound counts. A
        disabled one is not counted: an admin call took it out of rotation already (a rolling
        restart's drained replica answers 503 to its checks), and counting it would keep a
        replica that hangs meanwhile in rotation, its requests stuck on it rather than waiting
        for the drained one to come back."""
        return sum(1 for r in self._replicas if r.health is Health.UNHEALTHY and not r.disabled
                   and r.ejected_reason is not None and r.ejected_reason.outlier)

    def add(self, replica: Replica) -> None:
        if self.get(replica.id) is not None:
            raise DuplicateReplica(f"replica id {replica.id!r} already exists")
        if any(r.url == replica.url for r in self._replicas):
            raise DuplicateReplica(f"replica URL {replica.url} is already in the set")
        self._replicas = (*self._replicas, replica)
        replica.on_change = self.changed.pulse
        replica.backends = self
        self.changed.pulse()

    def remove(self, replica_id: str) -> Replica:
        replica = self.get(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        replica.removed = True
        self._replicas = tuple(r for r in self._replicas if r is not replica)
        return replica

    def next_id(self) -> str:
        taken = {r.id for r in self._replicas}
        return next(str(i) for i in range(len(taken) + 1) if str(i) not in taken)
