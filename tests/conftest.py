"""Fixtures of the tests in more than one directory: real `omni-dp serve` processes on
loopback (support/replica.py), started and stopped by pid. Each directory's conftest.py holds
the fixtures only its own tests use; plain helpers live in the `support` package."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from omni_dp.engine.options import DEFAULT_MODEL_ENV

from support.mps import daemons_under
from support.replica import Replica

# `omni-dp serve`'s default model is the trained voice where it is installed; the tests of the
# seeded engine rely on the preset `tiny` (deterministic, resumable, KV-sized), so every server
# a test starts without --model serves tiny. The voice's tests name it (tests/test_voice_run.py).
os.environ.setdefault(DEFAULT_MODEL_ENV, "tiny")


@pytest.fixture(autouse=True)
def no_mps_daemon_left_behind(request):
    """A test that starts a real MPS control daemon in its tmp_path must stop it: one that
    failed before its cleanup once left three running. Set up first, so this runs after
    every other fixture's teardown; a leaked daemon is stopped here and fails the test."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None:
        return
    leaked = daemons_under(tmp_path)
    _, alive = psutil.wait_procs(leaked, timeout=3)  # one that was told to quit may be exiting
    for process in alive:
        process.kill()
    assert not alive, (f"the test left MPS control daemon(s) {[p.pid for p in alive]} running "
                       "(now killed)")


@pytest.fixture
def start_replica(tmp_path):
    """Start replicas with given serve flags; every one is stopped by pid at teardown."""
    started: list[Replica] = []

    def start(*args: str, ready: bool = True) -> Replica:
        replica = Replica(tmp_path / f"replica_{len(started)}.log", *args)
        started.append(replica)
        return replica.wait_ready() if ready else replica

    yield start
    for replica in started:
        replica.stop(signal.SIGKILL if replica.proc.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="session")
def replica(tmp_path_factory):
    """A default tiny CPU replica shared by the tests that only send requests."""
    replica = Replica(tmp_path_factory.mktemp("shared") / "replica.log").wait_ready()
    yield replica
    replica.stop()
