"""Fixtures of the launcher tests: runs of `omni-dp launch` (support/launcher.py), each one
always cleaned up at teardown, by pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.launcher import MpsRun, Run, alive, real_mps_binary
from support.mps_hybrid import Hybrid
from support.wait import wait_for


@pytest.fixture
def runs(tmp_path):
    """Make Runs; each is cleaned up (down, then SIGKILL of token carriers) at teardown."""
    made: list[Run] = []

    def make(replicas: int = 2) -> Run:
        run = Run(tmp_path / f"r{len(made)}", replicas=replicas)
        made.append(run)
        return run

    yield make
    for run in made:
        run.cleanup()


@pytest.fixture
def mps_run(tmp_path):
    """A run with a short state dir under /tmp (the control socket path must fit 107 bytes).
    Afterwards, always: `omni-dp down`, then SIGKILL by pid whatever of the run is still there."""
    real = real_mps_binary()
    hybrid_dir = tmp_path / "hybrid"
    hybrid_dir.mkdir()
    state_dir = Path(tempfile.mkdtemp(prefix="odp", dir="/tmp"))
    run = MpsRun(state_dir, Hybrid(hybrid_dir, real), real, "t")
    try:
        yield run
    finally:
        if run.run_dir.exists():
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.cli("down", run.run_id, timeout=90)
        killed = run.leftovers()
        for pid in killed:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):  # the next test needs the CPUs
            wait_for("leftovers to exit", lambda: not any(alive(pid) for pid in killed), 10,
                     interval=0.1)
        shutil.rmtree(state_dir, ignore_errors=True)
