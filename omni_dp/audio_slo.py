"""What a listener hears of one audio answer, from when its chunks were written: the audio SLOs.

Pure: fed (time, seconds of audio) per written chunk, it says the time to first audio, the
intervals between chunks, the audio's duration, end-to-end latency, the real-time factor and
the largest underrun. The replica (engine/server.py) and the router (router/proxy.py) feed it
from where their bytes leave for the client; neither does any arithmetic of its own, so both
measure the same thing the same way. No I/O, no prometheus here (audio_slo_metrics.py exports).

The underrun is a real-time player's: it starts at the first audio and plays at real speed.
When a chunk arrives after the audio it had buffered ran out, the player stalled for the time
between the two (the underrun), and it plays on from the chunk's arrival. sglang-omni and
vllm-omni export the largest such stall per response (`audio_underrun_s`), and count responses
whose largest stall stays within fixed thresholds (`audio_continuity_ok_total{threshold_ms}`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The continuity thresholds, in milliseconds: the peers' own.
CONTINUITY_THRESHOLDS_MS = (100, 200, 500)


@dataclass(frozen=True)
class PlaybackReport:
    """One finished answer, as a listener heard it. Without timed audio (`timed` False: bytes
    that do not map to time, mp3 at the router), only `ttfa` and `e2e` are known."""

    ttfa: float | None  # start → first non-empty audio; None if none came
    e2e: float | None  # start → last audio; None if none came
    duration: float | None  # seconds of audio
    rtf: float | None  # e2e / duration; None without audio seconds
    underrun: float | None  # the largest stall, seconds (0 when none)

    def continuity_ok(self, threshold_ms: int) -> bool:
        """The largest underrun stayed within `threshold_ms` (to a nanosecond: clock sums are
        floats, and a stall of exactly the threshold is within it)."""
        return self.underrun is not None and self.underrun <= threshold_ms / 1000 + 1e-9


class PlaybackMeter:
    """One answer's audio as it is written: `add(time, seconds)` per chunk, `report()` at the
    end. Times are any monotonic clock's seconds (perf_counter), `start` the request's arrival.

    A plain class with slots, not a dataclass: the router calls `add` per relayed chunk, and
    its cost is a few float operations."""

    __slots__ = ("buffer_end", "duration", "first", "last", "start", "timed", "underrun")

    def __init__(self, start: float, timed: bool = True) -> None:
        self.start = start
        self.timed = timed  # whether `seconds` are seconds (else only whether there is audio)
        self.first: float | None = None  # when the first non-empty audio was written
        self.last: float | None = None  # when the last one was
        self.duration = 0.0  # seconds of audio written
        self.buffer_end = 0.0  # when the player's buffered audio runs out
        self.underrun = 0.0  # the largest stall so far

    def add(self, at: float, seconds: float) -> float | None:
        """A chunk of `seconds` of audio written at `at`; the interval since the previous
        chunk of audio, or None for the first (or a chunk without audio: `seconds` 0, which
        counts for nothing). Untimed, any positive `seconds` says "some audio"."""
        if seconds <= 0:
            return None
        last, self.last = self.last, at
        if last is None:
            self.first = at
            self.buffer_end = at + seconds
            self.duration = seconds
            return None
        stall = at - self.buffer_end
        if stall > 0:  # the player ran dry before this chunk came: it waits, then plays on
            if stall > self.underrun:
                self.underrun = stall
            self.buffer_end = at + seconds
        else:
            self.buffer_end += seconds
        self.duration += seconds
        return at - last

    @property
    def started(self) -> bool:
        """Some audio was written."""
        return self.first is not None

    def ttfa(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def report(self) -> PlaybackReport:
        """The answer as heard so far (at its end: as heard)."""
        if self.first is None or self.last is None:
            return PlaybackReport(None, None, None, None, None)
        e2e = self.last - self.start
        if not self.timed:
            return PlaybackReport(self.first - self.start, e2e, None, None, None)
        rtf = e2e / self.duration if self.duration > 0 else None
        return PlaybackReport(self.first - self.start, e2e, self.duration, rtf, self.underrun)
