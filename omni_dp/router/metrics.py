"""Prometheus metrics of the router; per-replica labels are the replica ids (bounded), and
every `reason` / `why` label takes one of a few fixed values (the proxy's failure kinds).

With `--workers K` (K > 1) the worker processes share one view through prometheus-client's
multiprocess mode: the parent sets PROMETHEUS_MULTIPROC_DIR before it spawns them, so every
counter and histogram lives in a memory-mapped file there, and whichever worker a scrape lands
on reads the sums over all of them. Custom collectors do not work in that mode, so each worker
writes its view of the replicas (in flight, routable, healthy, ejections, hangs) into
multiprocess gauges and counters: at every scrape it answers, and every second otherwise (a
sibling's part of a gauge can be a second old). In flight sums over the workers; routable and
healthy take the lowest (1 only while every worker routes to the replica); ejections and hangs
sum (each worker ejects on its own). A removed replica's series stay, gauges at 0, until the
router restarts: the mode cannot delete a series from its files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni_dp.audio_slo_metrics import AudioSloMetrics
from omni_dp.contract import Priority
from omni_dp.router.replicas import Backends, Ejected, Health, Replica

# Up to 4 minutes: long TTS streams must not all land in +Inf.
# Where several router workers share their metrics: prometheus-client reads it at import.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
            120, 240)


@dataclass(frozen=True)
class _ReplicaSeries:
    """A per-replica series read from the replica records: in one process at scrape time
    (_ReplicaCollector), or written for several workers' scrapes (_SharedReplicaMetrics)."""

    name: str
    help: str
    counter: bool  # a count only ever going up (else a gauge)
    mode: str  # a gauge's prometheus-client multiprocess mode across workers
    value: Callable[[Replica], int]


_REPLICA_SERIES = (
    _ReplicaSeries("omni_dp_router_in_flight", "Requests in flight per replica.", False,
                   "livesum", lambda r: r.in_flight),
    _ReplicaSeries("omni_dp_router_replica_routable", "1 if the replica receives traffic.",
                   False, "livemin", lambda r: int(r.routable)),
    _ReplicaSeries("omni_dp_router_replica_healthy", "1 healthy, 0 ejected or not yet checked.",
                   False, "livemin", lambda r: int(r.health is Health.HEALTHY)),
    _ReplicaSeries("omni_dp_router_ejections",
                   "Times a replica was ejected for failures or a hang.", True, "",
                   lambda r: r.num_ejections),
    _ReplicaSeries("omni_dp_router_hangs",
                   "Times a replica was found hung (no answer in time, and a failed health "
                   "check).", True, "", lambda r: r.num_hangs),
)


class _ReplicaCollector:
    """The replica series read from the replica records at scrape time."""

    def __init__(self, replicas: Callable[[], Backends]) -> None:
        self._replicas = replicas

    def collect(self):
        replicas = list(self._replicas())
        for series in _REPLICA_SERIES:
            family = (CounterMetricFamily if series.counter else GaugeMetricFamily)(
                series.name, series.help, labels=["replica"])
            for replica in replicas:
                family.add_metric([replica.id], series.value(replica))
            yield family


class _SharedReplicaMetrics:
    """What _ReplicaCollector reads at scrape time, written into multiprocess files instead."""

    def __init__(self, replicas: Callable[[], Backends], registry: CollectorRegistry) -> None:
        self._replicas = replicas
        self._metrics = {
            series.name: (Counter(series.name, series.help, ["replica"], registry=registry)
                          if series.counter else
                          Gauge(series.name, series.help, ["replica"], registry=registry,
                                multiprocess_mode=series.mode))
            for series in _REPLICA_SERIES}
        self._counted: dict[tuple[str, str], int] = {}  # what the counters hold already
        self._known: dict[str, Replica] = {}  # the records the last write read, by id

    def write(self) -> None:
        current = {replica.id: replica for replica in self._replicas()}
        for rid, known in self._known.items():
            if current.get(rid) is known:
                continue
            # removed, or added again under this id (maybe since the last write: the record
            # is another one): a new record counts from 0, and its series goes on from what
            # it holds by the new record's increments
            for series in _REPLICA_SERIES:
                if series.counter:
                    self._counted.pop((rid, series.name), None)
                elif rid not in current:
                    self._metrics[series.name].labels(rid).set(0)
        self._known = current
        for rid, replica in current.items():
            for series in _REPLICA_SERIES:
                metric, value = self._metrics[series.name], series.value(replica)
                if not series.counter:
                    metric.labels(rid).set(value)
                    continue
                delta = value - self._counted.get((rid, series.name), 0)
                if delta > 0:
                    metric.labels(rid).inc(delta)
                    self._counted[(rid, series.name)] = value


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Backends],
                 multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: this process is one of several router workers sharing it
        (PROMETHEUS_MULTIPROC_DIR was set before prometheus-client was imported here:
        checked, since otherwise its counters would stay in this process and /metrics
        would read an empty directory)."""
        if multiprocess_dir is not None and os.environ.get(MULTIPROC_ENV) != multiprocess_dir:
            raise ValueError(f"{MULTIPROC_ENV} must be {multiprocess_dir!r} in this process "
                             "before prometheus-client is imported (router/workers.py)")
        disable_created_metrics()
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self._shared: _SharedReplicaMetrics | None = None
        if multiprocess_dir is None:
            self.registry.register(_ReplicaCollector(replicas))
        else:
            self._shared = _SharedReplicaMetrics(replicas, self.registry)
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
        self.replica_waits = Counter(
            "omni_dp_router_replica_waits",
            "Times a request (new, retried, resumed, or a speech session) found no replica to "
            "go to and waited for one (--replica-wait), by how the wait ended: found, "
            "timed_out, stopping (the router began to stop), cancelled (the client left, or "
            "the drain cut it off).", ["outcome"], registry=self.registry)
        self.replica_wait = Histogram(
            "omni_dp_router_replica_wait_seconds",
            "Seconds each such wait for a replica to go to lasted.",
            buckets=_BUCKETS, registry=self.registry)
        self.ejections_suppressed = Counter(
            "omni_dp_router_ejections_suppressed",
            "Ejections not done because --max-ejection-percent of the replicas were ejected "
            "already (the replica stayed routable), by what would have ejected it: failures, "
            "hang.", ["reason"], registry=self.registry)
        self.client_disconnects = Counter(
            "omni_dp_router_client_disconnects", "Clients gone before the response ended.",
            registry=self.registry)
        self.duration = Histogram(
            "omni_dp_router_request_duration_seconds", "Request start to response end.",
            buckets=_BUCKETS, registry=self.registry)
        self.ttfb = Histogram(
            "omni_dp_router_ttfb_seconds", "Request start to the first response body byte.",
            buckets=_BUCKETS, registry=self.registry)
        self.queue_depth = Gauge(
            "omni_dp_router_queue_depth",
            "Requests waiting in their class's queue for an in-flight slot.", ["priority"],
            multiprocess_mode="livesum", registry=self.registry)
        self.queue_wait = Histogram(
            "omni_dp_router_queue_wait_seconds",
            "Seconds each request that queued for an in-flight slot waited, by class (those "
            "that timed out or left included).", ["priority"], buckets=_BUCKETS,
            registry=self.registry)
        self.queue_timeouts = Counter(
            "omni_dp_router_queue_timeouts",
            "Requests refused with 503 after waiting their class's --queue-timeout-CLASS for "
            "an in-flight slot.", ["priority"], registry=self.registry)
        self.preemptions = Counter(
            "omni_dp_router_preemptions",
            "Bulk requests taken back from a replica before their answer began, for a "
            "waiting interactive request, and queued again.", registry=self.registry)
        # The audio SLOs of speech answers (omni_dp_router_audio_*), on the bytes written to
        # the client: router/audio_slo.py. Histograms and counters: multiprocess-safe.
        self.audio = AudioSloMetrics("omni_dp_router_audio_", "replica", self.registry,
                                     "to the client")
        for priority in Priority:  # every class's series exists from the start, at 0
            self.queue_depth.labels(priority.label).set(0)
            self.queue_wait.labels(priority.label)
            self.queue_timeouts.labels(priority.label)

        self._requests: dict[tuple[str, int], Counter] = {}

    def write_shared(self) -> None:
        """With several workers: this worker's view of the replicas, into the shared files."""
        if self._shared is not None:
            self._shared.write()

    def exposition(self) -> bytes:
        """The text a scrape of /metrics gets: this process's registry, or with several
        workers the sums over all of them."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.write_shared()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)

    def count_request(self, replica_id: str, status: int) -> None:
        """One answer from a replica; its labelled child is looked up once per (replica,
        status), not on every request (`labels()` validates and locks each time)."""
        child = self._requests.get((replica_id, status))
        if child is None:
            child = self._requests[(replica_id, status)] = self.requests.labels(
                replica_id, str(status))
        child.inc()

    def count_wait(self, outcome: str, seconds: float) -> None:
        """One wait for a replica to go to, and how it ended."""
        self.replica_waits.labels(outcome).inc()
        self.replica_wait.observe(seconds)

    def count_suppressed(self, replica: Replica, why: Ejected) -> None:
        """An ejection not done for the bound on ejections (Backends.on_suppressed)."""
        self.ejections_suppressed.labels(why.value).inc()

    def set_queue_depth(self, priority: Priority, depth: int) -> None:
        self.queue_depth.labels(priority.label).set(depth)

    def forget(self, replica_id: str) -> None:
        """Drop the labelled series of a removed replica."""
        self._requests = {k: v for k, v in self._requests.items() if k[0] != replica_id}
        self.audio.forget(replica_id)
        for metric in (self.requests, self.upstream_errors):
            for labels in list(metric._metrics):  # prometheus_client keeps no public index
                if labels[0] == replica_id:
                    metric.remove(*labels)
