"""Prometheus metrics of one replica, in a registry of its own (no global state).

Every series carries `model_name` (the served model name), as vLLM's and SGLang's do, so their
dashboards can be adapted by renaming; docs/observability.md maps the names. `promtool check
metrics` is clean (tests/test_metrics_lint.py): counters end in _total, nothing else does, units
are base units (seconds), every family has HELP.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from omni_dp.audio_slo_metrics import AudioSloMetrics, MeteredAnswer
from omni_dp.contract import PRIORITY_NAMES, Priority
from omni_dp.engine.priority import QUEUE_WAIT_BUCKETS
from omni_dp.engine.scheduler import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MODEL_LABEL = "model_name"
PRIORITY_LABEL = "priority"


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
        yield from self._by_priority(stats)

    def _by_priority(self, stats: SchedulerStats):
        """Queue depth and first wait per priority class (engine/priority.py); every class
        always, 0 where the engine has none waiting."""
        depth = GaugeMetricFamily(
            "omni_dp_queue_depth", "Requests waiting for a slot of the running batch, by "
            "priority class.", labels=[MODEL_LABEL, PRIORITY_LABEL])
        wait = HistogramMetricFamily(
            "omni_dp_queue_wait_seconds", "Time a request waited in the queue before it first "
            "ran, by priority class.", labels=[MODEL_LABEL, PRIORITY_LABEL])
        empty = [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
        for name in PRIORITY_NAMES:
            labels = [*self._model, name]
            depth.add_metric(labels, stats.queue_depth.get(name, 0))
            counts = stats.queue_wait_counts.get(name, empty)
            cumulative, buckets = 0, []
            for bound, count in zip((*QUEUE_WAIT_BUCKETS, "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((str(float(bound)) if bound != "+Inf" else bound, cumulative))
            wait.add_metric(labels, buckets, stats.queue_wait_sum.get(name, 0.0))
        yield depth
        yield wait


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
        self._by_priority = Counter(
            "omni_dp_speech_requests_by_priority",
            "Speech requests (and speech sessions) admitted, by priority class.",
            [MODEL_LABEL, PRIORITY_LABEL], registry=self.registry,
        )
        for name in PRIORITY_NAMES:  # every class from the first scrape, at 0
            self._by_priority.labels(model_name, name)
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
        # The audio SLOs (omni_dp_audio_*), on the bytes written to the client.
        self.audio = AudioSloMetrics("omni_dp_audio_", MODEL_LABEL, self.registry,
                                     "to the client")

    def answer(self, fmt: str, priority: Priority, started: float) -> MeteredAnswer:
        """The meter of one admitted speech answer in `fmt` (a response_format, or sse),
        arrived at `started` (perf_counter)."""
        return MeteredAnswer(self.audio, fmt, priority.label, started)

    def count(self, outcome: str) -> None:
        """One speech request ended with `outcome` (ok, bad_request, rejected, failed, …)."""
        self._requests.labels(self.model_name, outcome).inc()

    def count_priority(self, priority: Priority) -> None:
        """One speech request (or session) of class `priority` was admitted."""
        self._by_priority.labels(self.model_name, priority.label).inc()
