"""What a supervision thread reports back to the loop: typed outcomes on a queue, which the loop
alone applies (the replica watches it keeps, the records it writes). A thread keeps its blocking
waits (a stop, a start, the gates) and never touches the loop's own state; the loop drains the
queue before it looks at a slot a thread has just let go, so it always acts on what the thread
did there.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GatesPassed:
    """A restarted replica passed every gate: its failed health checks count from zero."""

    index: int


@dataclass(frozen=True)
class GaveUp:
    """A replica's restart budget is spent: it and the group restarted with it (`members`,
    already stopped) are failed and stay out of the router."""

    index: int
    members: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class StepEnded:
    """A change's step thread ended: step n (from 1) of change `change`, how long it took,
    why it failed (None: it passed), and the replica a remove stopped, which the loop drops
    from the record."""

    change: str
    step: int
    seconds: float
    error: str | None = None
    removed: int | None = None


Outcome = GatesPassed | GaveUp | StepEnded


class Outcomes:
    """The queue between the threads and the loop (any thread puts; the loop takes)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.wake: Callable[[], None] | None = None  # the loop's, while it runs

    def report(self, outcome: Outcome) -> None:
        self._queue.put(outcome)
        wake = self.wake
        if wake is not None:
            wake()

    def take(self) -> list[Outcome]:
        """Everything reported so far, in order."""
        taken = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken
