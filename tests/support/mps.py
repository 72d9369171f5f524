"""The MPS tests' front ends: the scripted stand-in (Standin, run from mps_standin.py beside
this file) and the real control daemon's binary (real_control_binary). Their fixtures
(`standin`, `spawn`) are in tests/mps/conftest.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

STANDIN = Path(__file__).with_name("mps_standin.py")


class Standin:
    """An executable that answers like nvidia-cuda-mps-control, from a scenario file."""

    def __init__(self, directory: Path, monkeypatch) -> None:
        self.scenario = directory / "scenario.json"
        self.log = directory / "commands.log"
        self.binary = directory / "nvidia-cuda-mps-control"
        self.binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
        self.binary.chmod(self.binary.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("MPS_STANDIN_SCENARIO", str(self.scenario))
        self.set()

    def set(self, replies: dict | None = None, **special) -> None:
        self.scenario.write_text(json.dumps({"replies": replies or {}, "log": str(self.log),
                                             **special}))

    def commands(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


def real_control_binary() -> str | None:
    """The real daemon's binary, or None; FAIL (not skip) when the test script required it."""
    found = os.environ.get("OMNI_DP_MPS_CONTROL") or shutil.which("nvidia-cuda-mps-control")
    if found and os.access(found, os.X_OK):
        return found
    if os.environ.get("OMNI_DP_REQUIRE_MPS") == "1":
        pytest.fail("OMNI_DP_REQUIRE_MPS=1 but nvidia-cuda-mps-control is not installed "
                    "(scripts/install-mps-control should have fetched it)")
    pytest.skip("nvidia-cuda-mps-control not installed: run scripts/install-mps-control "
                "(scripts/test does) to test against the real daemon")
    return None


def daemons_under(directory: Path) -> list:
    """The MPS control daemons whose pipe directory lies under `directory` (a test's tmp_path):
    only a test that used that directory can have started them."""
    import psutil

    found = []
    for process in psutil.process_iter(["name"]):
        if process.info["name"] != "nvidia-cuda-mps-control":
            continue
        try:
            pipe = process.environ().get("CUDA_MPS_PIPE_DIRECTORY", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if pipe and Path(pipe).is_relative_to(directory):
            found.append(process)
    return found
