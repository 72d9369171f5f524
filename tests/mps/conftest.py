"""Fixtures of the MPS tests: the scripted front end and token-carrying test processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.mps import Standin


@pytest.fixture
def standin(tmp_path, monkeypatch) -> Standin:
    return Standin(tmp_path, monkeypatch)


@pytest.fixture
def spawn():
    """Start idle processes with a chosen environment; all are stopped by pid afterwards."""
    started: list[subprocess.Popen] = []

    def start(env_extra: dict[str, str] | None = None) -> int:
        env = {**os.environ, **(env_extra or {})}
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
        started.append(proc)
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
