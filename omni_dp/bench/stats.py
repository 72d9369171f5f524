"""The arithmetic of a bench run, pure: a point from its requests, a level as ranges over its
trials, the sweep that finds where throughput stops rising, and the host-bound verdict.

Ranges, not the best run: a level reports the lowest, median and highest of its trials, and
the sweep decides on medians. Failures are counted by kind and never dropped from `requests`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from omni_dp.bench.results import ConfigResult, LevelSummary, PointResult, Range, RequestResult

MIN_GAIN = 0.05  # a level must beat the best so far by this much to count as a rise
MAX_FAILURE_SHARE = 0.05
DEFAULT_START = 1
DEFAULT_MAX_CONCURRENCY = 256
# SM activity (GPU) or the replica's share of its cores (CPU) at saturation: below, the
# device waits on something serial on the host (the premise: DP helps); above, the device is
# the bound (DP will not help); between, the numbers do not say.
HOST_BOUND_BELOW = 0.6
DEVICE_BOUND_ABOVE = 0.85
CLIENT_BUSY = 0.9  # the load generator near one full core: it may be the bench's own bound
VERDICTS = ("host-bound", "gpu-bound", "compute-bound", "unknown")
CLIENT = "client"  # the load generator's role in cpu_util (omni_dp.bench.sampler)


class SampledWindow(Protocol):
    """What a sampler saw in a window (omni_dp.bench.sampler.Samples is one)."""

    cpu_util: dict[str, float] | None
    gpu_sm_util: float | None
    gpu_memory_bytes: int | None
    note: str | None


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated between ranks; None for none."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is from 0 to 100, got {q}")
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def failure_key(result: RequestResult) -> str:
    """How a failure is counted: "http 503", "timeout", "error" (an HTTP error without a
    status is "http")."""
    if result.outcome == "http" and result.status is not None:
        return f"http {result.status}"
    return result.outcome


def summarize_point(results: Sequence[RequestResult], window_s: float, concurrency: int,
                    trial: int, samples: SampledWindow | None = None) -> PointResult:
    """One trial at one concurrency: rates over the measured window (ok requests only), the
    latencies of the ok requests, every failure counted by kind."""
    if window_s <= 0:
        raise ValueError(f"a window lasts a positive time, got {window_s}")
    ok = [r for r in results if r.outcome == "ok"]
    failures = Counter(failure_key(r) for r in results if r.outcome != "ok")
    latencies = [r.latency_s for r in ok]
    rtfs = [r.latency_s / r.audio_s for r in ok if r.audio_s > 0]
    return PointResult(
        concurrency=concurrency, trial=trial, duration_s=window_s, requests=len(results),
        ok=len(ok), failures=dict(sorted(failures.items())),
        requests_per_s=len(ok) / window_s,
        audio_s_per_s=sum(r.audio_s for r in ok) / window_s,
        tokens_per_s=sum(r.tokens for r in ok) / window_s,
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        ttfb_p50_s=percentile((r.ttfb_s for r in ok if r.ttfb_s is not None), 50),
        rtf_p50=percentile(rtfs, 50),
        per_replica=dict(sorted(Counter(r.replica for r in ok if r.replica).items())),
        empty=sum(1 for r in ok if r.audio_s == 0 and r.tokens == 0),
        cpu_util=samples.cpu_util if samples else None,
        gpu_sm_util=samples.gpu_sm_util if samples else None,
        gpu_memory_bytes=samples.gpu_memory_bytes if samples else None,
        sampling_note=samples.note if samples else "not sampled",
    )


def value_range(values: Sequence[float]) -> Range:
    if not values:
        raise ValueError("a range of no values")
    return Range(min(values), statistics.median(values), max(values))


def _optional_range(values: Iterable[float | None]) -> Range | None:
    present = [v for v in values if v is not None]
    return value_range(present) if present else None


def summarize_level(points: Sequence[PointResult]) -> LevelSummary:
    """The trials of one concurrency as ranges; failures and requests summed."""
    if not points:
        raise ValueError("a level needs at least one trial")
    levels = {p.concurrency for p in points}
    if len(levels) != 1:
        raise ValueError(f"the trials of a level share one concurrency, got {sorted(levels)}")
    failures: Counter[str] = Counter()
    for point in points:
        failures.update(point.failures)
    return LevelSummary(
        concurrency=points[0].concurrency, trials=len(points),
        requests_per_s=value_range([p.requests_per_s for p in points]),
        audio_s_per_s=value_range([p.audio_s_per_s for p in points]),
        tokens_per_s=value_range([p.tokens_per_s for p in points]),
        latency_p99_s=_optional_range(p.latency_p99_s for p in points),
        ttfb_p50_s=_optional_range(p.ttfb_p50_s for p in points),
        failures=dict(sorted(failures.items())), requests=sum(p.requests for p in points),
    )


# How a sweep that ended without finding saturation says so (scaling.compared_level reads it:
# such a configuration is compared at its highest level, one whose first level broke a bound
# is not compared at all).
RAN_OUT = "throughput still rising"

class SaturationSweep:
    """Which concurrency to measure next, and when to stop: the given levels in order, or
    doubling from `start` up to `maximum`; stopped once the median throughput rose less than
    `min_gain` over the best level so far, the median p99 passed `max_p99_s`, or more than
    `max_failure_share` of a level's requests failed. `saturation` is then the best level
    within the bounds (None when not even the first was), `stop_reason` says why in words."""

    def __init__(self, levels: Sequence[int] | None = None, *, start: int = DEFAULT_START,
                 maximum: int = DEFAULT_MAX_CONCURRENCY, min_gain: float = MIN_GAIN,
                 max_p99_s: float | None = None,
                 max_failure_share: float = MAX_FAILURE_SHARE) -> None:
        if levels is not None:
            if not levels or any(c < 1 for c in levels) or list(levels) != sorted(set(levels)):
                raise ValueError(f"concurrency levels must be rising positive integers, got "
                                 f"{list(levels)}")
        elif not 1 <= start <= maximum:
            raise ValueError(f"the sweep needs 1 <= start <= maximum, got {start}, {maximum}")
        if min_gain < 0 or not 0 <= max_failure_share <= 1:
            raise ValueError("min_gain must be >= 0 and max_failure_share in 0..1")
        if max_p99_s is not None and max_p99_s <= 0:
            raise ValueError(f"max_p99_s must be positive, got {max_p99_s}")
        self.levels = tuple(levels) if levels is not None else None
        self.start = start
        self.maximum = maximum
        self.min_gain = min_gain
        self.max_p99_s = max_p99_s
        self.max_failure_share = max_failure_share
        self.recorded: list[LevelSummary] = []
        self.best: LevelSummary | None = None
        self.saturation: int | None = None
        self.stop_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def next_level(self) -> int | None:
        """The concurrency to measure next; None once the sweep has stopped."""
        if self.done:
            return None
        if not self.recorded:
            return self.levels[0] if self.levels is not None else self.start
        return self._after(self.recorded[-1].concurrency)

    def _after(self, concurrency: int) -> int | None:
        if self.levels is not None:
            later = [c for c in self.levels if c > concurrency]
            return later[0] if later else None
        return concurrency * 2 if concurrency * 2 <= self.maximum else None

    def record(self, level: LevelSummary) -> None:
        """Take the level just measured (it must be the one next_level named)."""
        expected = self.next_level()
        if level.concurrency != expected:
            raise ValueError(f"the sweep expected concurrency {expected}, got "
                             f"{level.concurrency}")
        self.recorded.append(level)
        reason = self._bound_passed(level)
        if reason is None:
            best = self.best
            rps = level.requests_per_s.median
            if best is not None and rps < best.requests_per_s.median * (1 + self.min_gain):
                reason = (f"throughput stopped rising: {rps:.3g} req/s (median) at concurrency "
                          f"{level.concurrency} is less than {self.min_gain:.0%} above "
                          f"{best.requests_per_s.median:.3g} at concurrency {best.concurrency}")
            else:
                self.best = level
                if self._after(level.concurrency) is None:
                    # still rising: no saturation was found (the report compares at the
                    # highest level and says "not saturated")
                    self.stop_reason = self._ran_out(level)
                    return
        if reason is not None:
            self.stop_reason = reason
            self.saturation = self.best.concurrency if self.best else None

    def _bound_passed(self, level: LevelSummary) -> str | None:
        failed = sum(level.failures.values())
        if level.requests == 0:
            return f"no request was sent at concurrency {level.concurrency}"
        share = failed / level.requests
        if share > self.max_failure_share:
            kinds = ", ".join(f"{n} {kind}" for kind, n in level.failures.items())
            return (f"{share:.0%} of the requests at concurrency {level.concurrency} failed "
                    f"({kinds}), more than the {self.max_failure_share:.0%} allowed")
        p99 = level.latency_p99_s
        if self.max_p99_s is not None and p99 is not None and p99.median > self.max_p99_s:
            return (f"p99 latency {p99.median:.3g} s (median) at concurrency "
                    f"{level.concurrency} passed the bound of {self.max_p99_s:g} s")
        return None

    def _ran_out(self, level: LevelSummary) -> str:
        if self.levels is not None:
            return (f"the given levels ended at concurrency {level.concurrency} with "
                    f"{RAN_OUT}: saturation may lie beyond")
        return (f"reached the maximum concurrency {self.maximum} with {RAN_OUT}: saturation "
                "may lie beyond")


def verdict(config: ConfigResult, cores: Mapping[str, int] | None = None) -> str:
    """Whether the configuration at its saturation was host-bound (the premise: a replica
    leaves its device idle, so more replicas help) or bound by its device, with the numbers.
    GPU: NVML's SM activity. CPU: the busiest replica's CPU use over the cores of its block
    (`cores`, by role, from the run's CPU blocks). Starts with one of VERDICTS."""
    at = config.saturation
    where = f"at saturation (concurrency {at})"
    if at is None and config.points:  # the sweep ran out still rising: its highest level
        at = max(p.concurrency for p in config.points)
        where = f"at its highest level (concurrency {at}, not saturated)"
    points = [p for p in config.points if p.concurrency == at]
    if not points:
        return "unknown: no saturation point was measured"
    sm = [p.gpu_sm_util for p in points if p.gpu_sm_util is not None]
    if sm:
        util = statistics.median(sm)
        return _classify(util, "gpu-bound", f"SM activity {util:.0%} {where}",
                         "the GPU waits on the host: data parallelism can help",
                         "the GPU is busy: data parallelism will not help")
    cpu = _replica_cpu(points, cores or {})
    if cpu is None:
        return "unknown: neither GPU activity nor the replicas' CPU use was sampled"
    role, used, block = cpu
    if block is None:
        return (f"unknown: {role} used {used:.2f} cores {where}, but its CPU block is not "
                "known")
    share = used / block
    text = _classify(share, "compute-bound",
                     f"{role} used {used:.2f} of its {block} cores ({share:.0%}) {where}",
                     "its cores wait on something serial: more replicas can help",
                     "its cores are busy: more replicas on them will not help")
    client = statistics.median(p.cpu_util.get(CLIENT, 0.0) for p in points if p.cpu_util)
    if client >= CLIENT_BUSY:
        text += (f"; the load generator itself used {client:.2f} of a core, so the bench "
                 "may be what bounds this")
    return text


def _classify(value: float, device_bound: str, numbers: str, low: str, high: str) -> str:
    if value < HOST_BOUND_BELOW:
        return f"host-bound: {numbers}; {low}"
    if value > DEVICE_BOUND_ABOVE:
        return f"{device_bound}: {numbers}; {high}"
    return (f"unknown: {numbers}, between {HOST_BOUND_BELOW:.0%} and "
            f"{DEVICE_BOUND_ABOVE:.0%}")


def _replica_cpu(points: Sequence[PointResult], cores: Mapping[str, int]
                 ) -> tuple[str, float, int | None] | None:
    """The replica with the highest share of its cores (of its cores used, where its block
    is not known): (role, cores used, cores of its block or None)."""
    found = []
    sampled = [p.cpu_util for p in points if p.cpu_util is not None]
    for role in sorted({r for util in sampled for r in util if r.startswith("replica")}):
        used = statistics.median(util.get(role, 0.0) for util in sampled)
        block = cores.get(role)
        found.append((used / block if block else used, role, used, block))
    if not found:
        return None
    _, role, used, block = max(found, key=lambda item: item[0])
    return role, used, block
