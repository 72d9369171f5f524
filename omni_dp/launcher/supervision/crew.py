"""What every part of one supervisor shares: the run, the voice, the stop event, the spawn
gate, the restart policy, and the probe through which it looks at the world (the unit tests
hand the parts a fake world and a fake clock through it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from omni_dp.blocking_http import http_json
from omni_dp.launcher.bringup.replicas import ReplicaControl
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.restart_policy import RestartPolicy
from omni_dp.mps.daemon import DaemonHealth, DaemonRecord, MpsDaemon
from omni_dp.net import port_taken
from omni_dp.procs import ProcessIdentity, is_alive


class SpawnGate:
    """Held while a restart starts a process; teardown closes it, so that nothing starts once
    teardown began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = False

    @contextlib.contextmanager
    def open(self) -> Iterator[bool]:
        """`with gate.open() as may:` start only if may."""
        with self._lock:
            yield not self.closed

    def close(self) -> None:
        with self._lock:
            self.closed = True


class Probe:
    """Everything the supervisor looks at: processes, /health, ports, the daemon."""

    def alive(self, identity: ProcessIdentity | None) -> bool:
        return identity is not None and is_alive(identity)

    def health(self, url: str, timeout_s: float) -> int:
        """GET /health's status; 0 when nothing answered."""
        return http_json("GET", url + "/health", timeout=timeout_s)[0]

    def router_workers(self, url: str, api_key: str | None) -> list[dict] | None:
        """GET /workers' entries (what the router thinks of each replica); None when the
        router did not answer with them."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        status, body = http_json("GET", url + "/workers", timeout=2.0, headers=headers)
        workers = body.get("workers") if status == 200 and isinstance(body, dict) else None
        return workers if isinstance(workers, list) else None

    def port_taken(self, port: int) -> bool:
        return port_taken("127.0.0.1", port)

    def daemon_health(self, record: DaemonRecord) -> DaemonHealth:
        return MpsDaemon(record.control()).health(record)  # control.log: small, read whole


@dataclass
class Crew:
    state: RunState
    replicas: ReplicaControl
    say: Callable[[str], None]
    stop: threading.Event  # set: the supervisor is stopping
    fail: Callable[[], None]  # stop the run with a failure (exit 3, state kept)
    policy: RestartPolicy
    gate: SpawnGate = field(default_factory=SpawnGate)
    probe: Probe = field(default_factory=Probe)
    clock: Callable[[], float] = time.time  # the restart policy's clock

    @property
    def drain_timeout(self) -> float:
        return self.state.supervision.drain_timeout
