"""Each GPU stage's busy time as wall-clock intervals: what `verify-mps --overlap` measures.

MPS attachment proves where a replica's kernels go, not that two replicas' kernels run at once;
these intervals let the CLI compare the replicas' busy times (omni_dp/mps/overlap.py). A stage
brackets each step with two timing events on its stream: `begin` before its first copy or
kernel, `end` after its last, before the wait the step already has. Nothing here makes the
host wait.

The device's clock is mapped to time.time() without a wait of our own. When a step's wait
returns, its end event has completed, so time.time() read right then (`synced`) is an upper
bound of that event's wall time, late by the read-back and the wake-up (microseconds; more when
another context held the GPU). Each earlier step's estimate, carried forward by the exact
difference between the two events (`elapsed_time`, no wait: both have completed), is another
upper bound; the least of them wins, so one prompt wake-up is enough for every later step.
The carried bound grows by CLOCK_CREEP so that a drift between the GPU's clock and the wall
clock cannot push it below the truth for long. A step that ended without a wait of its own (a
vocoder batch with nothing to read back) is resolved at its stage's next wait: by stream order
it completed before it.

Always on where a stage runs on CUDA: two event records and a few elapsed-time queries per
step (microseconds, against steps of milliseconds), and a run launched without a flag can
still be checked. On the CPU there are no kernels to time: `NotRecording` says so.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

KEEP_INTERVALS = 4096  # per stage: tens of seconds of steps, a few hundred KiB of JSON
MAX_PENDING = 256  # steps that ended without a wait, kept until the next one resolves them
CLOCK_CREEP = 1e-4  # s/s: more than a crystal's drift or an NTP slew


class TimingEvent(Protocol):
    """What a recorder needs of an event: torch.cuda.Event(enable_timing=True) is one."""

    def record(self, stream: Any = None) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # ms from this event to end_event


class BusyRecorder:
    """One stage's steps on one stream; the stage's thread calls begin/end/synced, any thread
    `snapshot`."""

    recording = True
    why = None

    def __init__(self, new_event: Callable[[], TimingEvent], *,
                 current_stream: Callable[[], Any] = lambda: None,
                 clock: Callable[[], float] = time.time, keep: int = KEEP_INTERVALS) -> None:
        self._new_event = new_event
        self._stream = current_stream
        self._clock = clock
        self._free: list[TimingEvent] = []  # resolved events, recorded again (no create)
        self._start: TimingEvent | None = None  # the open step's start
        self._pending: list[tuple[TimingEvent, TimingEvent]] = []
        self._anchor: tuple[TimingEvent, float] | None = None  # (event, its wall time bound)
        self._lock = threading.Lock()
        self._intervals: deque[tuple[float, float]] = deque(maxlen=keep)
        self._evicted_until = 0.0  # end of the latest interval the deque let go
        self.lost = 0  # steps dropped unresolved (more than MAX_PENDING without a wait)

    def _event(self) -> TimingEvent:
        event = self._free.pop() if self._free else self._new_event()
        event.record(self._stream())
        return event

    def begin(self) -> None:
        """Before the step's first copy or kernel."""
        if self._start is not None:
            self._free.append(self._start)
        self._start = self._event()

    def cancel(self) -> None:
        """The step queued no device work after all: forget its start."""
        if self._start is not None:
            self._free.append(self._start)
            self._start = None

    def end(self) -> None:
        """After the step's last kernel or copy, before its wait for the device."""
        if self._start is None:
            return
        self._pending.append((self._start, self._event()))
        self._start = None
        if len(self._pending) > MAX_PENDING:
            self._free.extend(self._pending.pop(0))
            self.lost += 1

    def synced(self) -> None:
        """Right after the step's wait: every pending step's events have completed."""
        if not self._pending:
            return
        now = self._clock()
        last = self._pending[-1][1]
        wall = now
        if self._anchor is not None:
            event, bound = self._anchor
            carried = bound + event.elapsed_time(last) / 1000 * (1 + CLOCK_CREEP)
            wall = min(wall, carried)
            self._free.append(event)
        resolved = [(wall - start.elapsed_time(last) / 1000, wall - end.elapsed_time(last) / 1000)
                    for start, end in self._pending]
        for start, end in self._pending:
            self._free.append(start)
            if end is not last:
                self._free.append(end)
        self._pending.clear()
        self._anchor = (last, wall)
        with self._lock:
            for interval in resolved:
                if len(self._intervals) == self._intervals.maxlen:
                    self._evicted_until = max(self._evicted_until, self._intervals[0][1])
                self._intervals.append(interval)

    def snapshot(self, since: float) -> tuple[list[tuple[float, float]], bool]:
        """The intervals that end after `since`, and whether older ones that did were let go."""
        with self._lock:
            return ([i for i in self._intervals if i[1] > since], self._evicted_until > since)


class NotRecording:
    """A stage whose steps are not timed; `why` says why (/gpu_busy passes it on)."""

    recording = False
    lost = 0

    def __init__(self, why: str) -> None:
        self.why = why

    def begin(self) -> None: ...

    def cancel(self) -> None: ...

    def end(self) -> None: ...

    def synced(self) -> None: ...

    def snapshot(self, since: float) -> tuple[list[tuple[float, float]], bool]:
        return [], False


Recorder = BusyRecorder | NotRecording
ON_CPU = "the replica runs on the CPU: there are no GPU kernels to time"


def recorder_for(device: torch.device) -> Recorder:
    """A recorder on the current stream of `device` (the stage's thread's) where it is CUDA."""
    if device.type != "cuda":
        return NotRecording(ON_CPU)
    return BusyRecorder(lambda: torch.cuda.Event(enable_timing=True),
                        current_stream=lambda: torch.cuda.current_stream(device))


def busy_answer(device: str, recorders: Mapping[str, Recorder], since: float,
                elsewhere: Sequence[str] = ()) -> dict:
    """The body of GET /gpu_busy: this process's timed stages' intervals since `since`.

    `elsewhere`: the stage processes that run a model stage (their steps are not in here)."""
    timed = {name: r for name, r in recorders.items() if r.recording}
    answer: dict = {"device": device, "recording": bool(timed), "since": since,
                    "now": time.time(), "stages": sorted(timed), "intervals": [],
                    "truncated": False, "lost": sum(r.lost for r in timed.values())}
    if elsewhere:
        answer["not_timed"] = list(elsewhere)
    if not timed:
        reasons = sorted({f"its {name} stage: {r.why}" if elsewhere else r.why
                          for name, r in recorders.items() if r.why})
        if elsewhere:
            reasons.append(f"stage processes {', '.join(elsewhere)} run model stages: "
                           "/gpu_busy times only the front process's")
        answer["why"] = "; ".join(reasons) or "no stage of this process is timed"
        return answer
    intervals: list[tuple[float, float]] = []
    for recorder in timed.values():
        some, truncated = recorder.snapshot(since)
        intervals += some
        answer["truncated"] = answer["truncated"] or truncated
    answer["intervals"] = [list(i) for i in sorted(intervals)]
    return answer
