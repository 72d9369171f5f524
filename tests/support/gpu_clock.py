"""TEST STAND-IN for CUDA timing events: a GPU clock the test moves by hand.

engine/gpu_busy.py's BusyRecorder takes an event factory; on a GPU it is
torch.cuda.Event(enable_timing=True). Here an event records the stand-in clock's time when
`record` is called (a real one records when the GPU reaches it), and `elapsed_time` is the
difference in milliseconds, as CUDA gives it. Nothing in omni_dp can reach this module.
"""

from __future__ import annotations


class FakeGpuClock:
    """GPU time `gpu` and the host's wall time `wall`, in seconds, both set by the test."""

    def __init__(self, gpu: float = 0.0, wall: float = 1_000.0) -> None:
        self.gpu = gpu
        self.wall = wall
        self.created = 0
        self.streams: list[object] = []  # the stream each record was given

    def event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self)

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float, *, wall_too: bool = True) -> None:
        self.gpu += seconds
        if wall_too:
            self.wall += seconds


class FakeEvent:
    def __init__(self, clock: FakeGpuClock) -> None:
        self.clock = clock
        self.at: float | None = None

    def record(self, stream: object = None) -> None:
        self.at = self.clock.gpu
        self.clock.streams.append(stream)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if self.at is None or end_event.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.at - self.at) * 1000.0
