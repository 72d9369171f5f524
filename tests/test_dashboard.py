"""The Grafana dashboard and provisioning in deploy/grafana/: the JSON loads, every panel has a
datasource and queries, every variable a query uses is defined, and promtool (Prometheus's own
parser) accepts every query, each written as a recording rule. That the queries return data
from a launched run is tests/launcher/test_dashboard_live.py's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from support.dashboard import BUILT_IN, GRAFANA, Query, load, panels, queries, substitute
from support.prometheus import promtool_path

VALUES = {"run": "run-a|run-b", "replica": ".*", "datasource": "omni-dp-prometheus"}


def check_rules(tmp_path: Path, found: list[Query]) -> subprocess.CompletedProcess:
    """`promtool check rules` on the queries, each a recording rule named after its panel."""
    rules = [{"record": f"dashboard:q{i}", "expr": q.expr} for i, q in enumerate(found)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return subprocess.run([promtool_path(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_every_panel_has_a_datasource_and_queries():
    dashboard = load()
    assert dashboard["uid"] == "omni-dp" and dashboard["panels"]
    found = panels(dashboard)
    assert len(found) >= 20
    for panel in found:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], f"panel {panel['title']!r} has no queries"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert target["expr"].strip(), panel["title"]
    ids = [p["id"] for p in dashboard["panels"] if p["type"] == "row"] + [p["id"] for p in found]
    assert len(set(ids)) == len(ids), "panel ids repeat"


def test_every_variable_a_query_uses_is_defined():
    dashboard = load()
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "run", "replica"} <= defined
    used = set()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            used |= {a or b for a, b in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", target["expr"])}
    assert used - set(BUILT_IN) <= defined, used - set(BUILT_IN) - defined
    substitute("$run ${replica}", VALUES)  # both forms
    with pytest.raises(KeyError):
        substitute("up{x=\"$nope\"}", VALUES)


def test_the_dashboard_covers_the_issue():
    """Fleet, per replica and per stage rows; throughput, TTFA, underrun, RTF, queue depths,
    restarts, retries, resumes, migrations, ejections: each is some query's series."""
    dashboard = load()
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert [r.split(":")[0].split(" ")[0] for r in rows] == ["Fleet", "Per", "Per"]
    exprs = " ".join(q.expr for q in queries(dashboard, VALUES))
    for series in ("omni_dp_router_requests_total", "omni_dp_audio_seconds_total",
                   "omni_dp_router_audio_ttfa_seconds_bucket", "omni_dp_audio_ttfa_seconds_bucket",
                   "omni_dp_router_audio_underrun_seconds_bucket",
                   "omni_dp_router_audio_continuity_ok_total",
                   "omni_dp_audio_real_time_factor_bucket", "omni_dp_router_queue_depth",
                   "omni_dp_queue_depth", "omni_dp_router_retries_total",
                   "omni_dp_router_resumes_total", "omni_dp_router_migrations_total",
                   "omni_dp_router_ejections_total", "omni_dp_router_in_flight", "resets("):
        assert series in exprs, series


def test_provisioning_points_at_the_dashboard_and_a_prometheus():
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/omni-dp.yaml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${PROMETHEUS_URL}"
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/omni-dp.yaml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].endswith("/omni-dp")
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["file_sd_configs"][0]["files"]  # what `omni-dp status --prometheus-sd` writes


def test_promtool_accepts_every_query(tmp_path):
    found = queries(load(), VALUES)
    done = check_rules(tmp_path, found)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(found)} rules found" in done.stdout


def test_promtool_rejects_a_broken_query(tmp_path):
    """The check can fail: one unbalanced parenthesis in one query."""
    found = queries(load(), VALUES)
    broken = [*found[:-1], Query("broken", "A", found[-1].expr + ")")]
    done = check_rules(tmp_path, broken)
    assert done.returncode != 0 and "dashboard:q" in done.stdout + done.stderr


def test_promtool_accepts_the_example_prometheus_config():
    done = subprocess.run([promtool_path(), "check", "config", str(GRAFANA / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
