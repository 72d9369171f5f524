"""The Grafana dashboard in deploy/grafana/ read as its panels' PromQL, with Grafana's template
variables replaced as Grafana would before it sends a query: for tests that check every
expression with promtool and run every query against a real Prometheus."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "omni-dp.json"
# Grafana's built-in intervals, as it would fill them for a short range scraped every second
# ($__rate_interval is at least four scrape intervals; $__range the dashboard's time range).
BUILT_IN = {"__rate_interval": "15s", "__interval": "1s", "__range": "2m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class Query:
    """One target of one panel: what a failure names."""

    panel: str
    ref_id: str
    expr: str

    @property
    def name(self) -> str:
        return f"panel {self.panel!r} target {self.ref_id}"


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that is not a row, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", []) if panel.get("type") == "row" else [panel]
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    """`$name` and `${name}` replaced by values (Grafana's built-ins by BUILT_IN's); an unknown
    variable is a KeyError, not a query with a `$` in it."""
    every = {**BUILT_IN, **values}
    return _VARIABLE.sub(lambda m: every[m.group(1) or m.group(2)], expr)


def queries(dashboard: dict, values: dict[str, str]) -> list[Query]:
    """Every panel's every target, its variables substituted."""
    return [Query(p["title"], t["refId"], substitute(t["expr"], values))
            for p in panels(dashboard) for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (`name{` or `name[`), functions and keywords
    aside: what the run must export for the query to mean anything."""
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr))
    return {n for n in names if n not in ("by", "without", "ignoring", "on", "group_left",
                                          "group_right")}
