"""What the supervisor can restart, what a restart takes with it, and which restarts run now.

A slot is one restartable part of a run: a replica, the router, the MPS daemon of one GPU. A
slot depends on another when restarting that other restarts it too: every replica is a client
of its own GPU's MPS daemon (one per GPU; a fault on one GPU takes only that GPU's replicas
with it); a weight-sharing follower maps its leader's weights. The dependencies are declared in
one place, `run_slots`. A sweep leaves a slot alone while a restart thread owns it,
anything it depends on, or anything depending on it, so no two threads ever restart the same
process; a sweep checks a slot after what it depends on (`order`), so a dead leader is seen,
and its group restarted, before its followers' own deaths are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

from omni_dp.launcher.planning.share_group import LEADER, followers
from omni_dp.runfile import ReplicaState, RunRecord, can_transition


@dataclass(frozen=True)
class Slot:
    kind: str  # replica | router | mps
    index: int | None = None  # a replica's index; an MPS daemon's GPU slot (RunRecord.gpus)

    @classmethod
    def replica(cls, index: int) -> Slot:
        return cls("replica", index)

    @classmethod
    def mps(cls, gpu: int) -> Slot:
        """The MPS daemon of GPU slot `gpu`."""
        return cls("mps", gpu)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind} {self.index}"


ROUTER = Slot("router")
CHANGE = Slot("change")  # a day-two change's thread (it holds each replica's slot in turn)


class Dependencies:
    """The slots of a run (in the order they were named) and what depends on what."""

    def __init__(self, slots: Iterable[Slot]) -> None:
        self.slots = list(slots)
        self._on: dict[Slot, set[Slot]] = {s: set() for s in self.slots}

    def declare(self, dependent: Slot, *, on: Slot) -> None:
        """A restart of `on` restarts `dependent` too."""
        if dependent == on or dependent in self.prerequisites(on):
            raise ValueError(f"{dependent} → {on} would make a cycle")
        self._on[dependent].add(on)

    def prerequisites(self, slot: Slot) -> set[Slot]:
        """Everything slot depends on, directly or not."""
        found: set[Slot] = set()
        todo = list(self._on.get(slot, ()))
        while todo:
            s = todo.pop()
            if s not in found:
                found.add(s)
                todo += self._on[s]
        return found

    def dependents(self, slot: Slot) -> list[Slot]:
        """Everything a restart of slot takes with it, in slot order."""
        return [s for s in self.slots if slot in self.prerequisites(s)]

    def related(self, slot: Slot) -> set[Slot]:
        return {slot, *self.prerequisites(slot), *self.dependents(slot)}

    def order(self) -> list[Slot]:
        """Every slot, each after what it depends on (a sweep checks the daemon before its
        clients: one fault, one group restart), otherwise in slot order."""
        done: list[Slot] = []

        def visit(slot: Slot) -> None:
            if slot not in done:
                for s in sorted(self._on[slot], key=self.slots.index):
                    visit(s)
                done.append(slot)

        for slot in self.slots:
            visit(slot)
        return done


def run_slots(record: RunRecord) -> Dependencies:
    """The one place a run's dependencies are declared: under --mps every replica on its own
    GPU's daemon (and no other: a GPU's fault restarts that GPU's replicas only); under
    --share-weights every follower on the leader (a dead leader takes its followers' weights
    with it, so its restart restarts them, leader first)."""
    replicas = [Slot.replica(r.index) for r in record.replicas]
    gpus = sorted({*(g.slot for g in record.gpus), *(r.gpu for r in record.replicas)})
    daemons = [Slot.mps(gpu) for gpu in gpus] if record.plan.mps else []
    deps = Dependencies([*replicas, ROUTER, *daemons])
    if record.plan.mps:
        for r in record.replicas:
            deps.declare(Slot.replica(r.index), on=Slot.mps(r.gpu))
    for index in followers(record.plan.share_weights, (r.index for r in record.replicas)):
        deps.declare(Slot.replica(index), on=Slot.replica(LEADER))
    return deps


def replica_group(deps: Dependencies, index: int) -> list[int]:
    """The replicas a restart of this one takes with it: itself, then its dependents."""
    return [index, *(s.index for s in deps.dependents(Slot.replica(index))
                     if s.kind == "replica" and s.index is not None)]


# A dependent in these states does not go with a restart of what it depends on: a FAILED one
# is out of its own restart budget (only the failed slot's history is charged, so it is never
# given up for another's crashes, nor brought back past its own budget by another's restart);
# a STOPPED one has nothing running to restart.
LEFT_OUT = frozenset({ReplicaState.FAILED, ReplicaState.STOPPED})


def restart_group(deps: Dependencies, record: RunRecord,
                  index: int) -> tuple[list[int], list[int]]:
    """What a restart of this replica takes with it, as (group, left out): itself, then each
    dependent that may restart (replica_group's order); the dependents in LEFT_OUT, or that the
    lifecycle does not let restart, stay as they are."""
    group, left = [index], []
    for i in replica_group(deps, index)[1:]:
        now = record.replicas[i].state
        restartable = now not in LEFT_OUT and can_transition(now, ReplicaState.RESTARTING)
        (group if restartable else left).append(i)
    return group, left


class Busy:
    """The slots with a restart thread running (a thread releases its slot when it ends)."""

    def __init__(self, deps: Dependencies) -> None:
        self.deps = deps
        self._threads: dict[Slot, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self, slot: Slot, target: Callable[..., None], *args: object,
              name: str | None = None) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(slot, target, args),
                                  name=name or f"restart-{slot}", daemon=True)
        with self._lock:
            self._threads[slot] = thread
        thread.start()
        return thread

    def _run(self, slot: Slot, target: Callable[..., None], args: tuple) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.pop(slot, None)

    @contextmanager
    def holding(self, slot: Slot):
        """The calling thread holds slot while inside (a change working on a replica)."""
        with self._lock:
            self._threads[slot] = threading.current_thread()
        try:
            yield
        finally:
            with self._lock:
                self._threads.pop(slot, None)

    def holder(self, slot: Slot) -> threading.Thread | None:
        with self._lock:
            return self._threads.get(slot)

    def slots(self) -> set[Slot]:
        with self._lock:
            return set(self._threads)

    def skipped(self, slot: Slot) -> bool:
        """Leave slot alone: a running restart owns it or will restart it."""
        return not self.slots().isdisjoint(self.deps.related(slot))

    def join(self, timeout_s: float) -> None:
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout_s)
