"""Prometheus metrics of one replica, in a registry of its own (no global state).

Every series carries `model_name` (the served model name), as vLLM's and SGLang's do, so their
dashboards can be adapted by renaming; README.md maps the names. `promtool check metrics` is
clean (tests/test_metrics_lint.py): counters end in _total, nothing else does, units are base
units (seconds), every family has HELP.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni_dp.engine.scheduler import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MODEL_LABEL = "model_name"


class _SchedulerCollector:
    """Reads the scheduler's gauges at scrape time rather than mirroring them on every step."""

    def __init__(self, stats: Callable[[], SchedulerStats | None], model_name: str) -> None:
        self._stats = stats
        self._model = [model_name]

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        usage = stats.num_pages_used / stats.num_pages_total if stats.num_pages_total else 0.0
        for name, doc, value in (
            ("omni_dp_requests_running", "Requests in the running batch.", stats.num_running),
            ("omni_dp_requests_waiting", "Requests queued for admission.", stats.num_waiting),
            ("omni_dp_kv_pages_used", "KV pages held by requests.", stats.num_pages_used),
            ("omni_dp_kv_pages_capacity", "KV pages in the pool.", stats.num_pages_total),
            ("omni_dp_kv_cache_usage_ratio", "Fraction of the KV pool's pages in use (0-1).",
             usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric(self._model, value)
            yield family
        for name, doc, value in (
            ("omni_dp_preemptions",
             "Running requests sent back to the queue for lack of KV pages.",
             stats.num_preemptions_total),
            ("omni_dp_generated_tokens",
             "Codec tokens sampled by the talker (end tokens included).",
             stats.num_generated_tokens_total),
        ):
            family = CounterMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric(self._model, value)
            yield family


class ReplicaMetrics:
    def __init__(self, stats: Callable[[], SchedulerStats | None], model_name: str) -> None:
        disable_created_metrics()  # the *_created series only double the scrape size
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(stats, model_name))
        self._requests = Counter(
            "omni_dp_speech_requests", "Speech requests by outcome.", [MODEL_LABEL, "outcome"],
            registry=self.registry,
        )
        self.audio_seconds = Counter(
            "omni_dp_audio_seconds", "Seconds of audio produced.", [MODEL_LABEL],
            registry=self.registry,
        ).labels(model_name)
        self.latency = Histogram(
            "omni_dp_request_latency_seconds", "Time from request to last audio byte.",
            [MODEL_LABEL], buckets=_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.first_audio = Histogram(
            "omni_dp_time_to_first_audio_seconds", "Time from request to first audio chunk.",
            [MODEL_LABEL], buckets=_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)

    def count(self, outcome: str) -> None:
        """One speech request ended with `outcome` (ok, bad_request, rejected, failed, …)."""
        self._requests.labels(self.model_name, outcome).inc()
