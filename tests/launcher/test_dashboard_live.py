"""Every query of the Grafana dashboard (deploy/grafana/) returns data from a real Prometheus
scraping a launched run under load: one launch of two replicas, Prometheus (Debian's build,
tests/support/prometheus.py) on loopback with storage of its own, scraping every second the
targets `omni-dp status --prometheus-sd` writes, through the example config the dashboard ships
with. A query that returns nothing fails the test by its panel's name; so does a series name no
target exports (the event counters' `or vector(0)` would hide it otherwise). Then one replica is
killed and the supervisor restarts it: the Restarts panel, which reads no restart counter (there
is none), must show it for that replica alone."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request

import pytest
import yaml

from omni_dp.contract import PRIORITY_HEADER

from support.dashboard import GRAFANA, Query, load, metric_names, panels, queries, substitute
from support.launcher import RESTART_TIMEOUT_S, SUPERVISION, kill_replica
from support.prometheus import Prometheus, prometheus_path
from support.wait import wait_for

LOAD_S = 10.0  # long enough for every replica to answer several streams between scrapes
FORMATS = (("pcm", "audio"), ("wav", "audio"), ("pcm", "sse"))
PRIORITIES = ("interactive", "default", "bulk")
_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def send_load(url: str, seconds: float, clients: int = 2) -> list[str]:
    """Speech requests through the router from `clients` threads for `seconds`, streamed and
    whole, in each format and class; returns the failures (the run should have none)."""
    failures: list[str] = []
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            fmt, stream_format = FORMATS[n % len(FORMATS)]
            stream = stream_format == "sse" or n % 4 != 3  # some whole answers too
            body = {"input": "Dashboards need data.", "response_format": fmt,
                    "stream_format": stream_format, "stream": stream, "seed": n}
            request = urllib.request.Request(
                url + "/v1/audio/speech", json.dumps(body).encode(),
                {"Content-Type": "application/json",
                 PRIORITY_HEADER: PRIORITIES[n % len(PRIORITIES)]})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    answer.read()
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"{body}: {exc!r}")
            n += clients

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 90)
    return failures


def scrape_config(sd_file: str) -> dict:
    """deploy/grafana/prometheus.yml, scraping every second the test's target list."""
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    [job] = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [sd_file], "refresh_interval": "1s"}]
    return config


def exported(metadata: dict, name: str) -> bool:
    """Whether a scraped target declared `name` (a histogram's parts by their family)."""
    return name == "up" or name in metadata or _SUFFIX.sub("", name) in metadata


def restarts(prometheus: Prometheus, dashboard: dict, run_id: str) -> dict[str, list[float]]:
    """The Restarts panel's values per replica (each target's, in order)."""
    [panel] = [p for p in panels(dashboard) if p["title"] == "Restarts"]
    found: dict[str, list[float]] = {}
    for target in panel["targets"]:
        expr = substitute(target["expr"], {"run": run_id, "replica": ".*"})
        for sample in prometheus.query(expr):
            found.setdefault(sample["metric"]["omni_dp_replica"], []).append(
                float(sample["value"][1]))
    return found


def unexported(prometheus: Prometheus, found: list[Query]) -> list[str]:
    """Each query's series names that no target declared (Prometheus's metadata API)."""
    metadata = prometheus.api("metadata")
    return sorted({f"{q.name}: {name}" for q in found for name in metric_names(q.expr)
                   if not exported(metadata, name)})


def empty_queries(prometheus: Prometheus, found: list[Query]) -> list[str]:
    return [f"{q.name}: {q.expr}" for q in found if not prometheus.query(q.expr)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_dashboard_query_returns_data_from_a_launched_run(runs, tmp_path):
    binary = prometheus_path()
    run = runs(2)
    run.launch(*SUPERVISION)
    sd_file = tmp_path / "targets.json"
    done = run.cli("status", run.run_id, "--prometheus-sd", str(sd_file))
    assert done.returncode == 0, done.stderr
    (tmp_path / "prometheus").mkdir()
    prometheus = Prometheus(binary, tmp_path / "prometheus", scrape_config(str(sd_file)))
    try:
        run_up = f'up{{omni_dp_run="{run.run_id}"}} == 1'
        wait_for("Prometheus to scrape the router and both replicas",
                 lambda: len(prometheus.query(run_up)) == 3, timeout=60)
        assert send_load(run.router_url, LOAD_S) == []
        time.sleep(3)  # a few more scrapes: the last answers' counts are in
        dashboard = load()
        unknown = unexported(prometheus, queries(dashboard, {"run": run.run_id, "replica": ".*"}))
        assert not unknown, "series no target exports:\n" + "\n".join(unknown)
        for replica in (".*", "0", "1"):  # all, then each replica alone
            found = queries(dashboard, {"run": run.run_id, "replica": replica})
            empty = empty_queries(prometheus, found)
            assert not empty, (f"replica={replica!r}: queries that returned nothing:\n"
                                 + "\n".join(empty))
        # No series counts restarts: the panel shows what one leaves (a counter reset, the
        # scrape down and up), for the replica that restarted alone.
        assert restarts(prometheus, dashboard, run.run_id) == {"0": [0, 0], "1": [0, 0]}
        kill_replica(run, 1)
        wait_for("the Restarts panel to show replica 1's restart",
                 lambda: all(n >= 1 for n in restarts(prometheus, dashboard,
                                                      run.run_id).get("1", [0])),
                 timeout=RESTART_TIMEOUT_S + 30)
        assert restarts(prometheus, dashboard, run.run_id)["0"] == [0, 0]
    finally:
        prometheus.stop()
