"""Prometheus metrics of one replica, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni_dp.engine.scheduler import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _SchedulerCollector:
    """Reads the scheduler's gauges at scrape time rather than mirroring them on every step."""

    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        for name, doc, value in (
            ("omni_dp_requests_running", "Requests in the running batch.", stats.num_running),
            ("omni_dp_requests_waiting", "Requests queued for admission.", stats.num_waiting),
            ("omni_dp_kv_pages_used", "KV pages held by requests.", stats.num_pages_used),
            ("omni_dp_kv_pages_total", "KV pages in the pool.", stats.num_pages_total),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "omni_dp_preemptions", "Running requests sent back to the queue for lack of KV pages.",
            value=stats.num_preemptions_total,
        )
        yield CounterMetricFamily(
            "omni_dp_generated_tokens", "Codec tokens sampled by the talker (end tokens included).",
            value=stats.num_generated_tokens_total,
        )


class ReplicaMetrics:
    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        disable_created_metrics()  # the *_created series only double the scrape size
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(stats))
        self.requests = Counter(
            "omni_dp_speech_requests", "Speech requests by outcome.", ["outcome"],
            registry=self.registry,
        )
        self.audio_seconds = Counter(
            "omni_dp_audio_seconds", "Seconds of audio produced.", registry=self.registry
        )
        self.latency = Histogram(
            "omni_dp_request_latency_seconds", "Time from request to last audio byte.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.first_audio = Histogram(
            "omni_dp_time_to_first_audio_seconds", "Time from request to first audio chunk.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
