"""A real Prometheus server on loopback for the dashboard's live test: Debian's build, which
scripts/test takes out of the `prometheus` package into .cache/promtool beside promtool and
exports as OMNI_DP_PROMETHEUS. Without it the test skips, except under CI
(OMNI_DP_REQUIRE_PROMETHEUS=1, set by scripts/test), where it fails.

The server gets a storage directory of its own, a free loopback port and a process group of
its own, and is stopped by it: SIGTERM, then SIGKILL if it lingers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from support.ports import LOOPBACK, free_port
from support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
_CACHED = ROOT / ".cache" / "promtool" / "usr" / "bin"


def _binary(name: str, variable: str, required: bool) -> str:
    found = os.environ.get(variable) or shutil.which(name)
    if found is None and (_CACHED / name).is_file():
        found = str(_CACHED / name)
    if found and os.access(found, os.X_OK):
        return found
    why = (f"{name} is not installed (scripts/test puts Debian's build in .cache/promtool and "
           f"exports {variable}, now {found!r})")
    if required:
        pytest.fail(why)
    pytest.skip(why)


def prometheus_path() -> str:
    """The prometheus binary; skips the test without one (fails under
    OMNI_DP_REQUIRE_PROMETHEUS=1)."""
    return _binary("prometheus", "OMNI_DP_PROMETHEUS",
                   bool(os.environ.get("OMNI_DP_REQUIRE_PROMETHEUS")))


def promtool_path() -> str:
    """promtool; skips without it, except under CI (as tests/test_metrics_lint.py)."""
    return _binary("promtool", "OMNI_DP_PROMTOOL",
                   os.environ.get("CI", "") not in ("", "0", "false"))


class Prometheus:
    """`prometheus` with `config` (a dict, written as YAML is JSON) under `workdir`."""

    def __init__(self, binary: str, workdir: Path, config: dict) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={LOOPBACK}:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        try:
            wait_for("prometheus to be ready", self._ready, timeout=30)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log()}"
        with contextlib.suppress(OSError), \
                urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
            return resp.status == 200
        return False

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/PATH?params; the `data` of a success (AssertionError otherwise)."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result (a vector's samples)."""
        return self.api("query", query=expr)["result"]

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
