"""A real SGLang model gateway (`smg launch`, PyPI sglang-router) on loopback, for the tests
that register workers with a fleet gateway; started in a process group of its own and stopped
by it.

scripts/setup-gateway installs it into .venv-gateway and scripts/test exports its path as
OMNI_DP_GATEWAY; without it these tests skip, except under CI (OMNI_DP_REQUIRE_GATEWAY=1,
set by scripts/test) where they fail.

The flags keep a test bounded and quiet: loopback only, Prometheus on a free loopback port of
its own (it cannot be turned off, and 29000 would collide), round robin (so a test knows where
a request goes), no retries and no circuit breaker (a request that fails, fails once), health
checks every second and one failure enough (a worker that stops answering is seen at once), a
registration given up after a few seconds, and a short shutdown grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.http_client import get
from support.ports import LOOPBACK, free_ports

STARTUP_GIVE_UP_S = 4  # --worker-startup-timeout-secs: a registration job's whole life
BOUNDED_FLAGS = (
    "--policy", "round_robin",
    "--disable-retries", "--disable-circuit-breaker",
    "--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
    "--health-failure-threshold", "1", "--health-success-threshold", "1",
    "--worker-startup-timeout-secs", str(STARTUP_GIVE_UP_S),
    "--worker-startup-check-interval", "1",
    "--shutdown-grace-period-secs", "1",
    "--request-timeout-secs", "30",
    "--log-level", "warn",
)


def smg_path() -> str:
    """The `smg` executable of scripts/setup-gateway; skips the test without it (fails under
    OMNI_DP_REQUIRE_GATEWAY=1)."""
    smg = os.environ.get("OMNI_DP_GATEWAY")
    if smg and os.access(smg, os.X_OK):
        return smg
    why = ("the SGLang model gateway is not installed (scripts/setup-gateway; scripts/test "
           f"exports OMNI_DP_GATEWAY, now {smg!r})")
    if os.environ.get("OMNI_DP_REQUIRE_GATEWAY"):
        pytest.fail(why)
    pytest.skip(why)


class SglangGatewayProcess:
    """One `smg launch` on free loopback ports; `extra` flags come after BOUNDED_FLAGS."""

    def __init__(self, smg: str, log_path: Path, *extra: str) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = log_path
        self.argv = [smg, "launch", "--host", LOOPBACK, "--port", str(self.port),
                     "--prometheus-host", LOOPBACK, "--prometheus-port", str(self.metrics_port),
                     *BOUNDED_FLAGS, *extra]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> SglangGatewayProcess:
        """Until /liveness answers 200 (the worker API is up; no worker is needed for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the gateway exited with {self.proc.returncode}; "
                                     f"log:\n{self.log_text()[-4000:]}")
            if get(self.url + "/liveness", timeout=2.0)[0] == 200:
                return self
            time.sleep(0.1)
        raise AssertionError(f"the gateway did not answer /liveness within {timeout:g} s; "
                             f"log:\n{self.log_text()[-4000:]}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL to it if still there after `timeout`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self._log.close()

    def __enter__(self) -> SglangGatewayProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
