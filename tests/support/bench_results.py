"""Hand-made bench results: a sweep per configuration from a few numbers, so report tests read
like the run they stand for (1 saturating at c=96, 2mps at c=64, a failed 3mps...)."""

from __future__ import annotations

import statistics

from omni_dp.bench.results import (
    BenchResult,
    ConfigResult,
    LevelSummary,
    PointResult,
    Range,
)
from omni_dp.bench.scaling import premise_text, scaling
from omni_dp.bench.stats import RAN_OUT

MACHINE = {"host": "bench-host", "cpus": 16,
           "gpu": {"name": "NVIDIA H200", "memory_bytes": 141 * 1024**3}}
SETTINGS = {"trials": 3, "duration_s": 30, "concurrency": [16, 32, 64, 96], "seed": 0}


def point(concurrency: int, trial: int, rps: float, *, replicas: int = 1,
          failures: dict[str, int] | None = None, duration_s: float = 30.0) -> PointResult:
    """One trial: `rps` ok requests per second for `duration_s`, spread evenly over the
    replicas (the first takes the remainder), speech at 2 s of audio per request."""
    ok = round(rps * duration_s)
    failures = dict(failures or {})
    per = [ok // replicas + (ok % replicas if i == 0 else 0) for i in range(replicas)]
    return PointResult(
        concurrency=concurrency, trial=trial, duration_s=duration_s,
        requests=ok + sum(failures.values()), ok=ok, failures=failures,
        requests_per_s=rps, audio_s_per_s=2.0 * rps, tokens_per_s=0.0,
        latency_p50_s=concurrency / max(rps, 1e-9) * 0.8,
        latency_p99_s=concurrency / max(rps, 1e-9) * 1.5, ttfb_p50_s=0.05 + 0.001 * concurrency,
        rtf_p50=0.3, per_replica={str(i): n for i, n in enumerate(per)})


def _range(values: list[float]) -> Range:
    return Range(min(values), statistics.median(values), max(values))


def level(points: list[PointResult]) -> LevelSummary:
    """The trials of one concurrency summarised as the runner does: ranges and sums."""
    failures: dict[str, int] = {}
    for p in points:
        for kind, count in p.failures.items():
            failures[kind] = failures.get(kind, 0) + count
    return LevelSummary(
        concurrency=points[0].concurrency, trials=len(points),
        requests_per_s=_range([p.requests_per_s for p in points]),
        audio_s_per_s=_range([p.audio_s_per_s for p in points]),
        tokens_per_s=_range([p.tokens_per_s for p in points]),
        latency_p99_s=_range([p.latency_p99_s for p in points]),
        ttfb_p50_s=_range([p.ttfb_p50_s for p in points]),
        failures=failures, requests=sum(p.requests for p in points))


def config(name: str, sweep: dict[int, list[float]], *, replicas: int = 1, mps: bool = False,
           saturation: int | None = None, failures: dict[int, dict[str, int]] | None = None,
           status: str = "ok", reason: str | None = None,
           verdict: str | None = "host-bound: replica CPU 0.98 of its 1 core") -> ConfigResult:
    """A configuration from {concurrency: [rps of each trial]}; `failures` per concurrency go
    into its first trial."""
    failures = failures or {}
    points = [point(c, t, rps, replicas=replicas, failures=failures.get(c) if t == 0 else None)
              for c, trials in sweep.items() for t, rps in enumerate(trials)]
    levels = tuple(level([p for p in points if p.concurrency == c]) for c in sweep)
    return ConfigResult(
        name=name, replicas=replicas, mps=mps, status=status, reason=reason,
        points=tuple(points), levels=levels, saturation=saturation,
        stop_reason=(f"median req/s rose < 5% from c={saturation} to the next level"
                     if saturation is not None else
                     f"reached the maximum concurrency with {RAN_OUT}: saturation may lie "
                     "beyond"),
        verdict=verdict)


def failed(name: str, reason: str, *, replicas: int = 1, mps: bool = False) -> ConfigResult:
    return ConfigResult(name=name, replicas=replicas, mps=mps, status="failed", reason=reason,
                        verdict=None)


def bench(*configs: ConfigResult, workload: str = "speech (tiny, 2 s clips)") -> BenchResult:
    """The whole run, its ratios and premise derived as the runner derives them."""
    return BenchResult(workload=workload, configs=tuple(configs),
                       scaling=scaling(configs), premise=premise_text(configs),
                       machine=dict(MACHINE), settings=dict(SETTINGS))


def single() -> ConfigResult:
    """Config 1: saturates at c=96 at 40 req/s median."""
    return config("1", {16: [20.0, 21.0, 19.0], 32: [30.0, 31.0, 29.5],
                        64: [38.0, 39.0, 37.0], 96: [40.0, 41.0, 39.0]}, saturation=96)


def two_mps() -> ConfigResult:
    """2mps: saturates at c=64 at 72 req/s median (1.8× config 1), some 503s and a timeout."""
    return config("2mps", {16: [30.0, 31.0, 29.0], 32: [55.0, 56.0, 54.0],
                           64: [72.0, 74.0, 70.0], 96: [72.5, 73.0, 71.0]},
                  replicas=2, mps=True, saturation=64,
                  failures={64: {"http 503": 5, "timeout": 1}}, status="degraded",
                  reason="6 of the requests at c=64 failed")


def typical() -> BenchResult:
    """1, 2mps (degraded), and 3mps that failed to launch."""
    return bench(single(), two_mps(),
                 failed("3mps", "launch failed: GPU memory: 3 × (weights 40.00 GiB + KV "
                               "8.00 GiB + overhead 2.00 GiB) = 150.00 GiB does not fit",
                        replicas=3, mps=True))
