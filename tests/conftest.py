"""Fixtures of the tests in more than one directory: real `omni-dp serve` processes on
loopback (support/replica.py), started and stopped by pid. Each directory's conftest.py holds
the fixtures only its own tests use; plain helpers live in the `support` package."""

from __future__ import annotations

import signal

import pytest

from support.replica import Replica


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
