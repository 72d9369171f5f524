"""What a supervision thread reports back to the loop: typed outcomes on a queue, which the loop
alone applies (the replica watches it keeps, the records it writes). A thread keeps its blocking
waits (a stop, a start, the gates) and never touches the loop's own state nor the record: each
record write it makes (record/writes.py) is queued with its outcomes and applied by the loop,
the thread waiting for it. The loop drains the queue before it looks at a slot a thread has just
let go, so it always acts on what the thread did there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_dp.launcher.record.writes import Write

if TYPE_CHECKING:
    from omni_dp.launcher.record.state import RunState


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


@dataclass(frozen=True)
class RouterLeftOut:
    """Replicas the router did not take back (out; asked again at every sweep), or that no
    longer need asking (not out); `every`: the list starts anew (a new router took all in)."""

    indices: tuple[int, ...]
    out: bool = True
    every: bool = False


class Posted:
    """A thread's record write (record/writes.py), handed to the loop: the thread waits until
    the loop applied it, so it reads its own write back and its writes land in its order."""

    def __init__(self, write: Write) -> None:
        self.write = write
        self._done = threading.Event()
        self._answer: object = None
        self._error: BaseException | None = None

    def settle(self, state: RunState) -> None:
        """The loop's side: apply it, and let the thread go on with what came of it."""
        try:
            self._answer = state.apply(self.write)
        except BaseException as exc:  # the writer's error is raised where the write was made
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> object:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._answer


Outcome = GatesPassed | GaveUp | StepEnded | RouterLeftOut | Posted


class Outcomes:
    """The queue between the threads and the loop (any thread puts; the loop takes). While the
    loop owns the record (own()), every record write a thread makes comes here too, in order
    with the outcomes, and the loop alone applies it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        # wake(sweep): the loop's, while it runs; sweep=False for a write, which is applied
        # without a sweep of its own (a sweep counts health checks)
        self.wake: Callable[[bool], None] | None = None
        self._owner: threading.Thread | None = None  # the loop's thread, while it owns
        self._state: RunState | None = None
        self._lock = threading.Lock()  # a write is queued only while the loop owns

    def own(self, state: RunState) -> None:
        """From now on the calling thread (the loop) alone applies the state's writes."""
        with self._lock:
            self._owner = threading.current_thread()
            self._state = state
            state.writer = self.write

    def release(self) -> None:
        """The loop no longer applies writes (teardown owns the run): every later write is
        applied where it is made; what was queued before is still the loop's to settle."""
        with self._lock:
            self._owner = None
            if self._state is not None:
                self._state.writer = None

    def write(self, change: Write) -> object:
        """RunState.writer while the loop owns: the loop's own write is applied at once, a
        thread's is queued for the loop and waited for."""
        with self._lock:
            state, owner = self._state, self._owner
            posted = None
            if owner is not None and threading.current_thread() is not owner:
                posted = Posted(change)
                self._queue.put(posted)
        assert state is not None
        if posted is None:
            return state.apply(change)
        wake = self.wake
        if wake is not None:
            wake(False)
        return posted.wait()

    def handed(self, outcome: Outcome) -> bool:
        """Queue an outcome for the loop when a thread other than the loop's makes it while
        the loop owns (True: the loop applies it, woken without a sweep); False: the caller
        applies it itself (it is the loop, or no loop runs)."""
        with self._lock:
            if self._owner is None or threading.current_thread() is self._owner:
                return False
            self._queue.put(outcome)
        wake = self.wake
        if wake is not None:
            wake(False)
        return True

    def report(self, outcome: Outcome) -> None:
        self._queue.put(outcome)
        wake = self.wake
        if wake is not None:
            wake(True)

    def take(self) -> list[Outcome]:
        """Everything reported so far, in order."""
        taken = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken
