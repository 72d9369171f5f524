"""What a bench run measured, typed: the messages between the load generator, the sweep, the
report and the JSON. Every number of the table is a field here, so the JSON carries them all.

A request is counted whatever became of it (ok, an HTTP error such as 503, a timeout, a broken
connection); a point is one (configuration, concurrency, trial); a level is the trials of one
concurrency summarised as ranges; a configuration that could not run (its launch failed, its
MPS attachment did not verify, its KV was unequal) is a ConfigResult with status "failed" and
its reason — reported, never dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RequestResult:
    """One request: `outcome` is "ok", "http" (status ≥ 400, e.g. 503), "timeout" or "error"
    (connection refused/reset, a stream that ended early)."""

    outcome: str
    status: int | None  # the HTTP status, when one came
    latency_s: float  # from send to the last byte (or to the failure)
    ttfb_s: float | None  # to the first audio/token byte of the body; None when none came
    audio_s: float = 0.0  # speech: seconds of audio received
    tokens: int = 0  # completions: tokens generated (usage.completion_tokens)
    replica: str | None = None  # the router's X-Omni-DP-Replica, where it says


@dataclass(frozen=True)
class Range:
    """Over the trials of one point: the lowest, the median and the highest value."""

    low: float
    median: float
    high: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PointResult:
    """One trial at one concurrency: what the load generator saw, and what was sampled."""

    concurrency: int
    trial: int
    duration_s: float  # of the measured window (warm-up excluded)
    requests: int  # every request sent in the window, whatever became of it
    ok: int
    failures: dict[str, int]  # outcome (or "http 503") -> count
    requests_per_s: float  # ok requests per second
    audio_s_per_s: float  # speech; 0 for completions
    tokens_per_s: float  # completions; 0 for speech
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttfb_p50_s: float | None  # time to first audio / token
    rtf_p50: float | None  # speech: latency / audio seconds (real-time factor); None else
    per_replica: dict[str, int] = field(default_factory=dict)  # ok requests by replica id
    # Sampled during the window: on CPU each process's CPU utilisation (1.0 = one core) by
    # role; on a GPU NVML's SM activity (0..1) and used memory; None where not sampled.
    cpu_util: dict[str, float] | None = None
    gpu_sm_util: float | None = None
    gpu_memory_bytes: int | None = None
    sampling_note: str | None = None  # what was not sampled, and why (no run directory...)
    empty: int = 0  # ok answers that held no audio (speech) or no token (completions)


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency of one configuration over its trials."""

    concurrency: int
    trials: int
    requests_per_s: Range
    audio_s_per_s: Range
    tokens_per_s: Range
    latency_p99_s: Range | None
    ttfb_p50_s: Range | None
    failures: dict[str, int]  # summed over the trials
    requests: int  # summed over the trials


@dataclass(frozen=True)
class ConfigResult:
    """One configuration (`1`, `2mps`, or the URL given): its sweep, or why it failed."""

    name: str  # "1", "2mps", "url"
    replicas: int | None
    mps: bool
    status: str  # "ok" | "failed" | "degraded" (ran, but some requests failed)
    reason: str | None  # why it failed or is degraded, in words
    points: tuple[PointResult, ...] = ()
    levels: tuple[LevelSummary, ...] = ()
    saturation: int | None = None  # the concurrency its throughput stopped rising at
    stop_reason: str | None = None  # why the sweep stopped there, in words
    verdict: str | None = None  # host-bound / gpu-bound / unknown, with the numbers


@dataclass(frozen=True)
class BenchResult:
    """The whole run: each configuration, and each DP configuration's ratio at saturation to
    the single replica, each at its own saturating concurrency (the premise, said with it)."""

    workload: str
    configs: tuple[ConfigResult, ...]
    scaling: dict[str, float]  # config name -> its median rps at saturation / config 1's
    premise: str
    machine: dict  # host, CPUs, GPU (name, memory) or none
    settings: dict  # trials, duration, concurrency levels, bounds, seed
