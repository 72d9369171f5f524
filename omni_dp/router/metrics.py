"""Prometheus metrics of one router process; per-replica labels are the replica ids (bounded),
and every `reason` / `why` label takes one of a few fixed values (the proxy's failure kinds)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni_dp.router.replicas import Backends

# Up to 4 minutes: long TTS streams must not all land in +Inf.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
            120, 240)


class _ReplicaCollector:
    """In-flight, health and ejections read from the replica records at scrape time."""

    def __init__(self, replicas: Callable[[], Backends]) -> None:
        self._replicas = replicas

    def collect(self):
        in_flight = GaugeMetricFamily(
            "omni_dp_router_in_flight", "Requests in flight per replica.", labels=["replica"])
        routable = GaugeMetricFamily(
            "omni_dp_router_replica_routable", "1 if the replica receives traffic.",
            labels=["replica"])
        healthy = GaugeMetricFamily(
            "omni_dp_router_replica_healthy", "1 healthy, 0 ejected or not yet checked.",
            labels=["replica"])
        ejections = CounterMetricFamily(
            "omni_dp_router_ejections", "Times a replica was ejected for failures or a hang.",
            labels=["replica"])
        hangs = CounterMetricFamily(
            "omni_dp_router_hangs",
            "Times a replica was found hung (no answer in time, and a failed health check).",
            labels=["replica"])
        for replica in self._replicas():
            in_flight.add_metric([replica.id], replica.in_flight)
            routable.add_metric([replica.id], int(replica.routable))
            healthy.add_metric([replica.id], int(replica.health.value == "healthy"))
            ejections.add_metric([replica.id], replica.num_ejections)
            hangs.add_metric([replica.id], replica.num_hangs)
        yield from (in_flight, routable, healthy, ejections, hangs)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Backends]) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(replicas))
        self.requests = Counter(
            "omni_dp_router_requests", "Proxied requests by replica and status.",
            ["replica", "status"], registry=self.registry)
        self.rejections = Counter(
            "omni_dp_router_admission_rejections", "Requests refused with 503 before routing.",
            ["reason"], registry=self.registry)
        self.retries = Counter(
            "omni_dp_router_retries",
            "Requests sent again to another replica before any byte reached the client, by "
            "what failed.", ["reason"], registry=self.registry)
        self.resumes = Counter(
            "omni_dp_router_resumes",
            "Answers continued by another replica after their replica failed mid-stream, by "
            "what failed.", ["reason"], registry=self.registry)
        self.migrations = Counter(
            "omni_dp_router_migrations",
            "LLM streams continued token for token by another replica after their replica "
            "failed mid-stream, by what failed.", ["reason"], registry=self.registry)
        self.streams_cut = Counter(
            "omni_dp_router_streams_cut",
            "Answers that ended cut after their first byte reached the client, by why they "
            "were not resumed.", ["why"], registry=self.registry)
        self.upstream_errors = Counter(
            "omni_dp_router_upstream_errors", "Failures talking to a replica, by kind.",
            ["replica", "kind"], registry=self.registry)
        self.client_disconnects = Counter(
            "omni_dp_router_client_disconnects", "Clients gone before the response ended.",
            registry=self.registry)
        self.duration = Histogram(
            "omni_dp_router_request_duration_seconds", "Request start to response end.",
            buckets=_BUCKETS, registry=self.registry)
        self.ttfb = Histogram(
            "omni_dp_router_ttfb_seconds", "Request start to the first response body byte.",
            buckets=_BUCKETS, registry=self.registry)

        self._requests: dict[tuple[str, int], Counter] = {}

    def count_request(self, replica_id: str, status: int) -> None:
        """One answer from a replica; its labelled child is looked up once per (replica,
        status), not on every request (`labels()` validates and locks each time)."""
        child = self._requests.get((replica_id, status))
        if child is None:
            child = self._requests[(replica_id, status)] = self.requests.labels(
                replica_id, str(status))
        child.inc()

    def forget(self, replica_id: str) -> None:
        """Drop the labelled series of a removed replica."""
        self._requests = {k: v for k, v in self._requests.items() if k[0] != replica_id}
        for metric in (self.requests, self.upstream_errors):
            for labels in list(metric._metrics):  # prometheus_client keeps no public index
                if labels[0] == replica_id:
                    metric.remove(*labels)
