"""Prometheus file-based service discovery for runs: `omni-dp status --prometheus-sd FILE`.

One scrape config (`file_sd_configs: [{files: [FILE]}]`) then covers the router and every
replica of every live run, however many there are: Prometheus rereads the file when it
changes. The format is Prometheus's file_sd JSON: a list of `{"targets": ["host:port"],
"labels": {name: value}}` groups, label names `[a-zA-Z_][a-zA-Z0-9_]*`, values strings.

Replicas listen on 127.0.0.1 only: a Prometheus on the run's host (or a sidecar there) scrapes
them; from elsewhere only the router is reachable (at the URL the run recorded).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

from omni_dp.files import atomic_write
from omni_dp.runfile import ReplicaRecord, RunRecord

METRICS_PATH = "/metrics"
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class TargetError(ValueError):
    """A recorded URL that names no host:port a scrape could reach; the message says which."""


def target_of(url: str) -> tuple[str, str]:
    """(`host:port`, scheme) of a recorded URL; an IPv6 host keeps its brackets."""
    parts = urlsplit(url)
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.scheme not in _DEFAULT_PORTS:
        raise TargetError(f"{url!r} is not an http(s)://host:port URL")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}", parts.scheme


def _group(url: str, labels: dict[str, str]) -> dict:
    target, scheme = target_of(url)
    extra = {"__scheme__": scheme} if scheme != "http" else {}
    return {"targets": [target], "labels": {**labels, "__metrics_path__": METRICS_PATH, **extra}}


def _replica_labels(record: RunRecord, replica: ReplicaRecord) -> dict[str, str]:
    return {"omni_dp_run": record.run_id, "omni_dp_role": "replica",
            "omni_dp_replica": str(replica.index),
            "omni_dp_gpu": record.gpu_record(replica.gpu).label}


def run_groups(record: RunRecord) -> list[dict]:
    """The run's router (where it was recorded, else where the plan put it), then each of its
    replicas, whatever their state: one that is down is a failed scrape (`up` 0), not gone."""
    router_url = record.router.url if record.router else record.plan.router.url
    groups = [_group(router_url, {"omni_dp_run": record.run_id, "omni_dp_role": "router"})]
    groups += [_group(r.url, _replica_labels(record, r)) for r in record.replicas]
    return groups


def file_sd_problems(groups: object) -> list[str]:
    """What makes this not a file_sd target list Prometheus accepts; empty when it is one."""
    if not isinstance(groups, list):
        return [f"a file_sd file is a JSON list of target groups, not {type(groups).__name__}"]
    problems = []
    for i, group in enumerate(groups):
        problems += [f"group {i}: {p}" for p in _group_problems(group)]
    return problems


def _group_problems(group: object) -> list[str]:
    if not isinstance(group, dict) or set(group) - {"targets", "labels"}:
        return ["must be an object with only `targets` and `labels`"]
    targets, labels = group.get("targets"), group.get("labels", {})
    problems = []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        problems.append("`targets` must be a list of \"host:port\" strings")
    else:
        problems += [f"target {t!r} is not host:port" for t in targets if not _is_host_port(t)]
    if not isinstance(labels, dict):
        return [*problems, "`labels` must be an object of strings"]
    for name, value in labels.items():
        if not LABEL_NAME.match(name):
            problems.append(f"label name {name!r} does not match {LABEL_NAME.pattern}")
        if not isinstance(value, str):
            problems.append(f"label {name!r} has value {value!r}, not a string")
    return problems


def _is_host_port(target: str) -> bool:
    host, sep, port = target.rpartition(":")
    return bool(sep and host and "/" not in host and port.isdigit() and 0 < int(port) < 65536)


def render(groups: list[dict]) -> str:
    problems = file_sd_problems(groups)
    assert not problems, problems  # built here: a problem is a bug in this module
    return json.dumps(groups, indent=2) + "\n"


def write_file_sd(path: Path, groups: list[dict]) -> None:
    """Replace `path` atomically (Prometheus never reads half a file), readable by a
    Prometheus running as another user: it holds addresses and run ids, no secret."""
    atomic_write(path, render(groups), mode=0o644)
