"""The audio SLO families (audio_slo.py's measures) as Prometheus histograms and counters.

One set of eight families, made twice: the replica's `omni_dp_audio_*` (labels model_name,
format, priority) and the router's `omni_dp_router_audio_*` (labels replica, format, priority).
Histograms and counters only: they work in prometheus-client's multiprocess mode, which the
router's --workers K uses. docs/contracts.md maps each name to sglang-omni's and vllm-omni's.

Interrupted answers (failed, cut off, client gone) count in streams_total{outcome=
"interrupted"} and in time to first audio and chunk intervals, never in e2e, duration, RTF,
underrun or continuity, as the peers count them: a cut answer's "duration" says nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from omni_dp.audio_slo import CONTINUITY_THRESHOLDS_MS, PlaybackMeter

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 240)
_INTERVAL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
_DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10)
# 0 first: most answers have no underrun at all, and a dashboard wants that share exactly.
_UNDERRUN_BUCKETS = (0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
FORMAT_LABEL = "format"
PRIORITY_LABEL = "priority"
OUTCOMES = ("completed", "interrupted")


class Tally:
    """One answer's observations of a histogram, counted here and added to it at once.

    The router relays an answer in many chunks; Histogram.observe per chunk (a lock, a bucket
    walk, in multiprocess mode an mmap write per value) was most of the meter's per-chunk
    cost. Here a chunk costs a bisect and two adds; `add_to` writes each touched bucket once.
    It writes prometheus-client's Histogram children's `_sum` and `_buckets`, which have no
    public bulk API (tests/test_audio_slo.py checks the result equals observe()'s)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # the histogram's upper bounds, +Inf last
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def add_to(self, child) -> None:
        """Into a Histogram child of the same bounds: as if each value had been observed."""
        if not any(self.counts):
            return
        child._sum.inc(self.total)
        for bucket, count in zip(child._buckets, self.counts, strict=True):
            if count:
                bucket.inc(count)


@dataclass(frozen=True)
class AudioSeries:
    """The labelled children of one (who, format, priority): looked up once, not per chunk."""

    ttfa: object
    e2e: object
    duration: object
    rtf: object
    interval: object
    underrun: object
    continuity: tuple  # (threshold_ms, counter child) per threshold
    completed: object
    interrupted: object


class AudioSloMetrics:
    """The eight families under `prefix` (e.g. "omni_dp_audio_"), in `registry`; `who` is the
    first label's name (model_name at a replica, replica at the router)."""

    def __init__(self, prefix: str, who: str, registry: CollectorRegistry, where: str) -> None:
        labels = [who, FORMAT_LABEL, PRIORITY_LABEL]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=registry)

        self.ttfa = histogram(
            "ttfa_seconds", f"Request arrival to the first non-empty audio byte {where}.",
            _LATENCY_BUCKETS)
        self.e2e = histogram(
            "e2e_latency_seconds", f"Request arrival to the last audio byte {where} "
            "(completed answers).", _LATENCY_BUCKETS)
        self.duration = histogram(
            "duration_seconds", f"Seconds of audio written {where} in a completed answer.",
            _DURATION_BUCKETS)
        self.rtf = histogram(
            "real_time_factor", "End-to-end latency over audio duration (completed answers; "
            "under 1: faster than real time).", _RTF_BUCKETS)
        self.interval = histogram(
            "chunk_interval_seconds", f"Time between consecutive non-empty audio writes "
            f"{where}.", _INTERVAL_BUCKETS)
        self.underrun = histogram(
            "underrun_seconds", "Per completed answer, the largest stall a real-time player "
            "started at the first audio byte would hear (0: none).", _UNDERRUN_BUCKETS)
        self.continuity = Counter(
            prefix + "continuity_ok", "Completed answers whose largest underrun stayed within "
            "threshold_ms.", [*labels, "threshold_ms"], registry=registry)
        self.streams = Counter(
            prefix + "streams", "Audio answers begun, by how they ended: completed, or "
            "interrupted (failed, cut off, or the client gone).", [*labels, "outcome"],
            registry=registry)
        self._series: dict[tuple[str, str, str], AudioSeries] = {}
        self.interval_bounds = (*_INTERVAL_BUCKETS, float("inf"))

    def series(self, who: str, fmt: str, priority: str) -> AudioSeries:
        """The children of one label set, made (every threshold and outcome at 0) on first
        use: every series that exists has its continuity thresholds declared."""
        key = (who, fmt, priority)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = AudioSeries(
                self.ttfa.labels(*key), self.e2e.labels(*key), self.duration.labels(*key),
                self.rtf.labels(*key), self.interval.labels(*key), self.underrun.labels(*key),
                tuple((ms, self.continuity.labels(*key, str(ms)))
                      for ms in CONTINUITY_THRESHOLDS_MS),
                self.streams.labels(*key, "completed"), self.streams.labels(*key, "interrupted"))
        return found

    def forget(self, who: str) -> None:
        """Drop a removed replica's series, as the router drops its other per-replica series
        (a scrape names only the replicas it routes to; the soak checks it after a scale)."""
        self._series = {k: v for k, v in self._series.items() if k[0] != who}
        for family in (self.ttfa, self.e2e, self.duration, self.rtf, self.interval,
                       self.underrun, self.continuity, self.streams):
            for labels in list(family._metrics):  # prometheus_client keeps no public index
                if labels[0] == who:
                    family.remove(*labels)


class MeteredAnswer:
    """One answer's meter and where it reports: TTFA at the first audio, the rest (chunk
    intervals included) at `finish`. `who` (the replica at the router) is fixed by the first
    audio's writer."""

    __slots__ = ("done", "fmt", "intervals", "meter", "metrics", "priority", "series")

    def __init__(self, metrics: AudioSloMetrics, fmt: str, priority: str, start: float,
                 timed: bool = True) -> None:
        self.meter = PlaybackMeter(start, timed)
        self.metrics = metrics
        self.fmt = fmt
        self.priority = priority
        self.series: AudioSeries | None = None
        self.done = False  # finished: counted once, whatever path ends it after
        # chunk intervals, added to their histogram at the end (Tally says why)
        self.intervals = Tally(metrics.interval_bounds) if timed else None

    def add(self, at: float, seconds: float, who: str) -> None:
        """`seconds` of audio written at `at` (perf_counter), by `who`."""
        interval = self.meter.add(at, seconds)
        if interval is not None:
            if self.intervals is not None:
                self.intervals.observe(interval)
        elif self.series is None and self.meter.first is not None:
            self.series = self.metrics.series(who, self.fmt, self.priority)
            self.series.ttfa.observe(self.meter.first - self.meter.start)

    def finish(self, completed: bool, who: str) -> None:
        """The answer ended, whole (`completed`) or not; `who` labels it if no audio came.
        Only the first call counts."""
        if self.done:
            return
        self.done = True
        series = self.series or self.metrics.series(who, self.fmt, self.priority)
        if self.intervals is not None:
            self.intervals.add_to(series.interval)
        if not completed:
            series.interrupted.inc()
            return
        series.completed.inc()
        report = self.meter.report()
        if report.e2e is not None:
            series.e2e.observe(report.e2e)
        if report.underrun is None:  # untimed, or no audio at all
            return
        series.duration.observe(report.duration)
        if report.rtf is not None:
            series.rtf.observe(report.rtf)
        series.underrun.observe(report.underrun)
        for ms, child in series.continuity:
            if report.continuity_ok(ms):
                child.inc()
