"""An `omni-dp serve` subprocess on loopback, started and stopped by pid (the root
conftest's `replica` and `start_replica` fixtures make them)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from support.http_client import get

_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class Replica:
    """One `omni-dp serve` subprocess; `--port 0`, the port read back from its log."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self.args = ["--port", "0", "--threads", "1", *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_dp", "serve", *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self.url = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text()

    def wait_listening(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log_text())
            if match:
                self.url = f"http://{match.group(1)}:{match.group(2)}"
                return
            self._check_alive()
            time.sleep(0.05)
        raise TimeoutError(f"replica never listened; log:\n{self.log_text()}")

    def wait_ready(self, timeout: float = 120) -> Replica:
        self.wait_listening(timeout)
        deadline, delay = time.monotonic() + timeout, 0.02
        while time.monotonic() < deadline:
            if get(self.url + "/health")[0] == 200:
                return self
            self._check_alive()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise TimeoutError(f"replica never became healthy; log:\n{self.log_text()}")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            code = self.proc.returncode
            raise RuntimeError(f"replica exited with {code}; log:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def info(self) -> dict:
        status, _, body = get(self.url + "/get_server_info")
        assert status == 200, body
        return json.loads(body)

    def metric(self, name: str, default: float | None = None) -> float:
        """One sample from this replica's /metrics (metric_of)."""
        return metric_of(self.url, name, default)


def metric_of(url: str, name: str, default: float | None = None) -> float:
    """One sample from `url`/metrics (a replica's or a router's): `name`, or
    `name{label="value",...}` for a labelled one.

    The labels given must be among the sample's (every replica series also has `model_name`).
    A series /metrics lacks is an AssertionError unless `default` is given: pass it only
    where the series may legitimately not exist yet (a labelled counter before its first
    increment). A failed scrape is always an AssertionError.
    """
    status, _, body = get(url + "/metrics")
    assert status == 200, f"GET /metrics for {name}: status {status} {body[:200]!r}"
    wanted_name, _, label_text = name.partition("{")
    wanted = dict(_LABEL.findall(label_text))
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == wanted_name and wanted.items() <= sample.labels.items():
                return sample.value
    if default is None:
        raise AssertionError(f"/metrics has no series {name}")
    return default
