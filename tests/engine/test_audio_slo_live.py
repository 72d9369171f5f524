"""The audio SLOs on real processes: an underrun made by a stalled stage shows in the replica's
/metrics and, for the same stream, in the router's; an answer whose client hangs up counts as
interrupted at both, and in no underrun.

One launch: a tiny seeded CPU replica whose vocoder runs in a process of its own (so it can be
SIGSTOPped mid-stream, the way a descheduled or swapping stage stalls), behind a real
`omni-dp router --workers 2` (its metrics in prometheus-client's multiprocess files). Each test
uses a priority class of its own, so each reads its own series.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse

import pytest

from omni_dp.audio_slo import PlaybackMeter

from support.http_client import get
from support.ports import LOOPBACK, free_port
from support.replica import Replica, metric_of
from support.wait import wait_for

SPEECH = "/v1/audio/speech"
RATE = 24_000  # X-Sample-Rate of every answer: 16-bit mono pcm
# Seed 82 speaks every token of this input (no early end): 300 tokens are 12 s of audio, about
# 7 s of work on a 2-core machine, so the stream still runs while its vocoder is stopped.
BODY = {"input": "Cut me off.", "seed": 82, "max_new_tokens": 300, "response_format": "pcm"}
STALL_S = 2.0
# What a later reader (the client) and an earlier writer (replica, router) may see apart of the
# same stall: scheduling on a loaded machine, not a measurement error of the meter.
SLACK_S = 0.3


class Router:
    """`omni-dp router --workers 2` in front of one replica, stopped by pid."""

    def __init__(self, log_path, replica_url: str) -> None:
        self.url = f"http://{LOOPBACK}:{free_port()}"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_dp", "router", "--port", self.url.rsplit(":", 1)[1],
             "--replica", f"r0={replica_url}", "--workers", "2"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def wait_ready(self) -> Router:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()
            return self.log_path.read_text().count("router listening on") >= 2
        wait_for("the router's 2 workers listening", ready, 30)
        wait_for("the router routing to r0", lambda: self.metric(
            'omni_dp_router_replica_routable{replica="r0"}', 0) == 1, 30)
        return self

    def metric(self, name: str, default: float | None = None) -> float:
        return metric_of(self.url, name, default)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # it and its workers: its own group
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(replica, router, the vocoder process's pid)."""
    logs = tmp_path_factory.mktemp("audio_slo")
    replica = Replica(logs / "replica.log", "--model", "tiny", "--device", "cpu",
                      "--max-total-tokens", "2048", "--vocoder.process", "voc")
    router = None
    try:
        replica.wait_ready()
        vocoder = next(r["pid"] for r in replica.info()["processes"] if r["role"] == "voc")
        router = Router(logs / "router.log", replica.url).wait_ready()
        yield replica, router, vocoder
    finally:
        if router is not None:
            router.stop()
        replica.stop()


def stream(url: str, priority: str):
    """A streamed speech request; (connection, response) with the head read."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", SPEECH, json.dumps(BODY), headers={"X-Omni-DP-Priority": priority})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn, response


def series(priority: str, **more) -> str:
    labels = {"format": "pcm", "priority": priority, **more}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


@pytest.mark.slow
def test_a_stalled_stage_is_an_underrun_at_the_replica_and_the_router(fleet):
    replica, router, vocoder = fleet
    conn, response = stream(router.url, "interactive")
    heard = PlaybackMeter(time.perf_counter())  # the client's own ears, for reference
    first = response.read1(65536)
    heard.add(time.perf_counter(), len(first) / 2 / RATE)
    os.kill(vocoder, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(vocoder, signal.SIGCONT)
    total = len(first)
    while chunk := response.read1(65536):
        heard.add(time.perf_counter(), len(chunk) / 2 / RATE)
        total += len(chunk)
    conn.close()
    assert total == 300 * 1920  # whole: 300 tokens of 960 samples
    client = heard.report().underrun
    # What the client had buffered at the stop is at most what it read by then (a chunk or
    # two): the stall it heard is most of STALL_S.
    assert client >= STALL_S - 2 * len(first) / 2 / RATE - SLACK_S, client
    at_replica = series("interactive")
    at_router = series("interactive", replica="r0")
    wait_for("the router's stream counted", lambda: router.metric(
        "omni_dp_router_audio_streams_total" + at_router[:-1] + ',outcome="completed"}', 0) == 1,
        10)
    for where, name, labels in (
            (replica, "omni_dp_audio_", at_replica),
            (router, "omni_dp_router_audio_", at_router)):
        assert where.metric(f"{name}underrun_seconds_count{labels}") == 1
        underrun = where.metric(f"{name}underrun_seconds_sum{labels}")
        assert underrun >= client - SLACK_S, (name, underrun, client)
        ok = labels[:-1] + ',threshold_ms="500"}'
        assert where.metric(f"{name}continuity_ok_total{ok}") == 0
        assert where.metric(f"{name}duration_seconds_sum{labels}") == pytest.approx(12.0)
        assert where.metric(f"{name}real_time_factor_count{labels}") == 1
        assert where.metric(f"{name}ttfa_seconds_count{labels}") == 1
        assert where.metric(f"{name}chunk_interval_seconds_count{labels}") >= 10
        print(f"{name}underrun: {underrun:.3f} s (the client heard {client:.3f} s)")


@pytest.mark.slow
def test_a_client_that_hangs_up_is_an_interrupted_stream_at_both(fleet):
    replica, router, _ = fleet
    conn, response = stream(router.url, "bulk")
    assert response.read1(65536)
    conn.sock.shutdown(2)
    conn.close()
    at_replica, at_router = series("bulk"), series("bulk", replica="r0")
    for where, name, labels in (
            (replica, "omni_dp_audio_", at_replica),
            (router, "omni_dp_router_audio_", at_router)):
        interrupted = f"{name}streams_total{labels[:-1]},outcome=\"interrupted\"}}"
        wait_for(f"{name} interrupted", lambda w=where, n=interrupted: w.metric(n, 0) == 1, 30)
        assert where.metric(f"{name}ttfa_seconds_count{labels}") == 1
        assert where.metric(f"{name}underrun_seconds_count{labels}") == 0
        assert where.metric(f"{name}e2e_latency_seconds_count{labels}") == 0
        completed = f"{name}streams_total{labels[:-1]},outcome=\"completed\"}}"
        assert where.metric(completed) == 0
    assert get(replica.url + "/health")[0] == 200
